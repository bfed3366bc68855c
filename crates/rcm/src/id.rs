//! `CmId`: the rdma_cm communication identifier, its state machine, and what the engines'
//! events do to it.
//!
//! Lock order: an id's state lock, then a device's engine lock, then a device's tables. The
//! engine lock is never held while events are routed, callbacks run or teardowns happen.

use crate::device::{DeviceInner, ServiceListen};
use crate::event::{ConnParam, Event, UdMessage, UdParam, Unreachable};
use crate::fabric::{Fabric, FabricInner};
use crate::iwarp::{ConnKey, IwEvent};
use crate::qp_attr::AccessFlags;
pub use crate::qp_attr::{QpAttr, QpState};
use crate::remote::{IdInfo, Op, RemoteId, Reply, Sink};
use crate::slot::{ChannelCore, DestroyOutcome, Flow, Slot, Target};
use crate::sync;
use crate::waitq::WaitQueue;
use crate::{Error, Result};
use rcm_proto::ib::{
    self, AcceptParams, CepHandle, CmEvent, ConnectParams, PathParams, SidrParams, SidrReplyParams,
};
use rcm_proto::iw;
use rcm_wire::cm::{RejReason, SidrStatus};
use rcm_wire::cma::{self, CmaHdr, PortSpace, CMA_HDR_LEN};
use rcm_wire::Gid;
use std::any::Any;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

/// rdma_cm id states (`enum rdma_cm_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Created.
    Idle,
    /// Address resolution running.
    AddrQuery,
    /// A local device reaches the destination.
    AddrResolved,
    /// Route resolution running.
    RouteQuery,
    /// Ready to connect.
    RouteResolved,
    /// Connecting (active), or a connect request not yet answered / accepted (passive).
    Connect,
    /// Connected.
    Established,
    /// Disconnected, rejected or unreachable: only destroy (or waiting for timewait) is left.
    Disconnect,
    /// Bound to a local address and port.
    AddrBound,
    /// Listening.
    Listen,
    /// The device was removed: only destroy is valid.
    DeviceRemoval,
    /// Being destroyed.
    Destroying,
}

/// The user's handler: called with the id and the event, one call at a time per id.
pub type Handler = Arc<dyn Fn(&CmId, Event) -> Flow + Send + Sync>;

/// What `connect` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectOptions {
    /// User private data: at most 56 bytes (RC) or 180 (UD), after rdma_cm's 36-byte header;
    /// on iWARP at most [`IWARP_PRIVATE_DATA_MAX`] (252; 256 on a device speaking MPA
    /// revision 1 only), with no header.
    pub private_data: Vec<u8>,
    /// Responder resources.
    pub responder_resources: u8,
    /// Initiator depth.
    pub initiator_depth: u8,
    /// QP retry count (clamped to 7).
    pub retry_count: u8,
    /// RNR retry count (clamped to 7).
    pub rnr_retry_count: u8,
    /// QP number to announce when no QP is attached (`None`: a fresh soft QPN).
    pub qpn: Option<u32>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            private_data: Vec::new(),
            responder_resources: 1,
            initiator_depth: 1,
            retry_count: 7,
            rnr_retry_count: 7,
            qpn: None,
        }
    }
}

/// What `accept` answers with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptOptions {
    /// Private data: at most 196 bytes (REP) or 136 (SIDR_REP); 252 on iWARP (256 answering
    /// an MPA revision-1 Request).
    pub private_data: Vec<u8>,
    /// Responder resources.
    pub responder_resources: u8,
    /// Initiator depth.
    pub initiator_depth: u8,
    /// RNR retry count.
    pub rnr_retry_count: u8,
    /// QP number when no QP is attached.
    pub qpn: Option<u32>,
}

impl Default for AcceptOptions {
    fn default() -> Self {
        AcceptOptions {
            private_data: Vec::new(),
            responder_resources: 1,
            initiator_depth: 1,
            rnr_retry_count: 7,
            qpn: None,
        }
    }
}

/// A soft QP: rcm does not own the data path, but it keeps the CM's rules about QPs.
#[derive(Debug)]
pub(crate) struct SoftQp {
    pub qpn: u32,
    /// Connected, or a connect/accept is under way with it.
    pub in_use: bool,
}

#[derive(Debug, Default, Clone)]
struct Conn {
    remote_qpn: u32,
    remote_psn: u32,
    local_psn: u32,
    local_qpn: u32,
    responder_resources: u8,
    initiator_depth: u8,
    retry_count: u8,
    rnr_retry_count: u8,
    ack_timeout: u8,
    accepted: bool,
}

pub(crate) struct IdState {
    pub state: State,
    src: Option<SocketAddr>,
    bound: bool,
    dst: Option<SocketAddr>,
    pub device: Option<Arc<DeviceInner>>,
    cep: Option<CepHandle>,
    /// Boxed: only listeners have it, and inline it would cost every id 40 bytes.
    listening: Option<Box<Listening>>,
    path: PathParams,
    /// Inline: only ever touched under this state lock.
    qp: Option<SoftQp>,
    /// A QP number the fabric handed out that this id holds besides its QP's (0: none): the
    /// one a connect or accept without a QP went by, or a destroyed QP's that its
    /// connection still goes by. Given back at the teardown, so that no other connection of
    /// this CA goes by it meanwhile (see `qpns.rs`).
    leased_qpn: u32,
    conn: Conn,
    /// Shared with the `with_context` calls running now, which clone it so that they run
    /// the user's closure with no lock held; a teardown waits for those clones to go.
    context: Option<Arc<dyn Any + Send + Sync>>,
    removed: bool,
    reuse: bool,
    disconnected_reported: bool,
    /// iWARP: `disconnect` came while the connection was being set up; it closes once up
    /// (iw_cm_disconnect waits for the connect to finish, then closes).
    iw_close_when_up: bool,
    /// Passive child: its listener, and whether the connect request is still unseen.
    listener: Option<Weak<IdInner>>,
    pub request_unseen: bool,
    /// Passive child: its request holds a place in the listener's backlog (until delivered).
    in_backlog: bool,
    /// iWARP: the device's TCP stream this id owns.
    /// (Keys start at 1: the niche keeps this 8 bytes.)
    iw: Option<std::num::NonZeroUsize>,
}

/// What only a listener has.
#[derive(Default)]
struct Listening {
    /// The engine listens it holds: per device, the service ID.
    on: Vec<(Arc<DeviceInner>, u64)>,
    wildcard: bool,
    backlog: usize,
    /// Children whose connect request is not delivered to the application yet.
    undelivered: usize,
    /// Its children (each leaves when destroyed).
    children: foldhash::HashMap<u64, Weak<IdInner>>,
}

/// What few ids have.
#[derive(Default)]
struct Extra {
    remote: std::sync::OnceLock<Arc<dyn RemoteId>>,
    mail: Mail,
    /// UD: the PSN of the next UD SEND.
    ud_psn: std::sync::atomic::AtomicU32,
}

/// What an id receives besides events.
#[derive(Default)]
struct Mail {
    /// iWARP: Send messages received and not yet taken (`recv_message`).
    inbox: WaitQueue<Vec<u8>>,
    /// UD: datagrams received for this id's QPN and not yet taken (`recv_ud`), at most
    /// [`UD_RECV_QUEUE`].
    ud_inbox: WaitQueue<UdMessage>,
}

pub(crate) struct IdInner {
    pub key: u64,
    pub ps: PortSpace,
    pub fabric: Arc<FabricInner>,
    pub slot: Arc<Slot<Event>>,
    pub st: Mutex<IdState>,
    /// Serialises API calls on this id (Linux bug class 2: concurrent calls on one id). It
    /// is held across engine calls; the state lock never is, because routing an engine event
    /// takes the state lock of the id it names.
    op: Mutex<()>,
    /// What few ids have (a provider, received messages), made on first use: one pointer
    /// on every id instead of a field for each.
    extra: std::sync::OnceLock<Box<Extra>>,
}

/// The largest payload of one UD datagram ([`CmId::send_ud`]): the largest IB MTU. The path
/// MTU may be smaller (rxe on a 1500-byte link: 1024), and the peer drops what exceeds it.
pub const UD_MAX_PAYLOAD: usize = 4096;

/// How often a waiting [`CmId::recv_message`] looks whether its id is still live.
const RECV_LIVENESS_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// How many received UD datagrams a UD id keeps until taken ([`CmId::recv_ud`]); beyond
/// that, new ones are dropped and counted ([`crate::UdStats::queue_full`]).
pub const UD_RECV_QUEUE: usize = 1024;

/// An rdma_cm communication identifier. Cloning gives another handle to the same id; the id
/// lives until destroyed (dropping handles does not destroy it).
#[derive(Clone)]
pub struct CmId(pub(crate) Arc<IdInner>);

impl std::fmt::Debug for CmId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CmId({})", self.0.key)
    }
}

impl PartialEq for CmId {
    fn eq(&self, o: &Self) -> bool {
        Arc::ptr_eq(&self.0, &o.0)
    }
}
impl Eq for CmId {}

/// A librdmacm-style event channel: events of the ids bound to it, in order, taken with
/// `get_event`. An event holds its id; dropping it acks it.
#[derive(Clone)]
pub struct EventChannel(pub(crate) Arc<ChannelCore<Event>>);

impl Default for EventChannel {
    fn default() -> Self {
        Self::new()
    }
}

impl EventChannel {
    /// A new channel.
    pub fn new() -> Self {
        EventChannel(ChannelCore::new())
    }

    /// Sets how long [`EventChannel::get_event`] polls for an event before it sleeps
    /// (default [`crate::DEFAULT_SPIN`]; zero sleeps at once). See [`crate::FabricConfig::spin`].
    ///
    /// While it polls, a waiting thread also receives for the device it last called (busy
    /// polling, as `SO_BUSY_POLL` has an application poll the NIC): the answer to its
    /// `connect`, say, is received, handled and taken by this one thread, and the device's
    /// own thread stands aside until the poll's deadline. On an iWARP device the thread
    /// looks at the device's TCP streams (their readiness) and handles what they bring.
    /// Events for callback ids among what it receives go to the fabric's callback threads,
    /// never to this one.
    /// [`Device::busy_polled`](crate::Device::busy_polled) counts what waiters received.
    /// For ids a provider holds (a daemon's), the thread polls what the provider offers
    /// ([`crate::remote::RemoteId::busy_poll`]; the daemon client's session connection).
    pub fn set_spin(&self, d: std::time::Duration) {
        self.0.set_spin(d);
    }

    /// The next event, waiting up to `timeout` (`None`: forever). The event holds its id and
    /// is acked when dropped; while any event of an id is held, a blocking `destroy` of that
    /// id fails with [`Error::EventsOutstanding`] rather than hanging.
    pub fn get_event(&self, timeout: Option<std::time::Duration>) -> Option<ChannelEvent> {
        let mut deadline = crate::slot::Deadline::new(timeout);
        loop {
            let ready = if crate::device::holding() || crate::remote::owes_answers() {
                // Held datagrams go out, and the answers owed to pipelined calls are awaited,
                // before this thread waits (see `SendBatch`, `Pipeline`).
                let r = self.0.take(&mut crate::slot::Deadline::now(), || None);
                if r.is_none() {
                    crate::fabric::before_wait();
                }
                r
            } else {
                None
            };
            let (slot, event) = if let Some(r) = ready {
                r
            } else {
                self.0.take(&mut deadline, crate::device::busy_poll_hint)?
            };
            let Some(id) = owner_of(&slot) else {
                slot.ack();
                continue;
            };
            if let Event::ConnectRequest { listener, .. } = &event {
                // The request is its listener's event, held as such: the listener's blocking
                // destroy is refused while it is held; a request whose listener is being
                // destroyed dies unseen (rejected). Not the child's: ucma counts it among the
                // listener's events reported, so the child may be rejected and destroyed
                // before the request is acked, as librdmacm allows.
                if !listener.0.slot.hold_for_other() {
                    slot.ack();
                    drop(id.begin_destroy());
                    continue;
                }
                let held = listener.0.slot.clone();
                request_delivered(&id.0);
                slot.ack();
                return Some(ChannelEvent {
                    id,
                    event: Some(event),
                    slot: held,
                });
            }
            return Some(ChannelEvent {
                id,
                event: Some(event),
                slot,
            });
        }
    }

    /// Events waiting (including ones of ids destroyed since, which are skipped).
    pub fn pending(&self) -> usize {
        self.0.len()
    }
}

fn owner_of(slot: &Arc<Slot<Event>>) -> Option<CmId> {
    slot.owner()
        .and_then(|a| a.downcast::<IdInner>().ok())
        .map(CmId)
}

/// An event taken from a channel. Dropping it acks it. While it is held, a blocking
/// destroy of the id it belongs to is refused (`EventsOutstanding`): a connect request
/// belongs to its listener, not to the child it names (which may be destroyed meanwhile).
pub struct ChannelEvent {
    id: CmId,
    event: Option<Event>,
    /// The slot the event is held on: the id's own, or a connect request's listener's.
    slot: Arc<Slot<Event>>,
}

impl ChannelEvent {
    /// The id the event is for (for a connect request: the new child id).
    pub fn id(&self) -> &CmId {
        &self.id
    }

    /// The event.
    pub fn event(&self) -> &Event {
        self.event.as_ref().unwrap_or(&Event::Disconnected)
    }

    /// Takes the event's payload out (the event stays held until this value is dropped).
    pub fn take(&mut self) -> Option<Event> {
        self.event.take()
    }
}

impl Drop for ChannelEvent {
    fn drop(&mut self) {
        self.slot.ack();
    }
}

impl std::fmt::Debug for ChannelEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChannelEvent({:?}, {:?})", self.id, self.event)
    }
}

fn new_state() -> IdState {
    IdState {
        state: State::Idle,
        src: None,
        bound: false,
        dst: None,
        device: None,
        cep: None,
        listening: None,
        path: PathParams::default(),
        qp: None,
        leased_qpn: 0,
        conn: Conn::default(),
        context: None,
        removed: false,
        reuse: false,
        disconnected_reported: false,
        iw_close_when_up: false,
        listener: None,
        request_unseen: false,
        in_backlog: false,
        iw: None,
    }
}

/// Wraps the user's handler as the slot's callback.
fn callback(h: Handler) -> Target<Event> {
    Target::Callback(Arc::new(
        move |owner: Option<Arc<dyn Any + Send + Sync>>, ev: Event| {
            let Some(inner) = owner.and_then(|o| o.downcast::<IdInner>().ok()) else {
                return Flow::Continue;
            };
            // A connect request runs as a callback of its listener (the scheduler's `gate`):
            // the listener's blocking destroy waits for it, and a request whose listener is
            // being destroyed dies with it, unseen (rejected), never reaching here.
            if let Event::ConnectRequest { .. } = &ev {
                request_delivered(&inner);
            }
            h(&CmId(inner), ev)
        },
    ))
}

fn build(fabric: &Arc<FabricInner>, ps: PortSpace, target: Target<Event>) -> CmId {
    let key = fabric.new_key();
    let inner = Arc::new(IdInner {
        key,
        ps,
        fabric: fabric.clone(),
        slot: Slot::new(target, fabric.scheduler()),
        st: Mutex::new(new_state()),
        op: Mutex::new(()),
        extra: std::sync::OnceLock::new(),
    });
    inner.slot.set_owner(inner.clone());
    CmId(inner)
}

impl crate::slot::SlotOwner for IdInner {
    fn teardown(self: Arc<Self>) {
        teardown(&self);
    }
    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }
}

/// Makes a fully built id visible to fabric-wide walks (device removal, shutdown). Once the
/// fabric is shutting down nothing is published: the id is destroyed instead (no event of
/// it is delivered) and this returns false.
fn publish(id: &CmId) -> bool {
    {
        let mut table = sync::lock(&id.0.fabric.ids);
        if !id.0.fabric.shut.load(std::sync::atomic::Ordering::SeqCst) {
            table.insert(id.0.key, Arc::downgrade(&id.0));
            return true;
        }
    }
    drop(id.begin_destroy());
    false
}

/// Whether a connect request's child, just published, was destroyed after it joined its
/// listener (the listener's teardown takes its children): then its own teardown may have
/// run before the id table and the device's routing entry had it, and the caller takes
/// those entries out again (each would otherwise stay for good). A teardown that comes
/// later finds them and removes them itself: the slot stops being live before it runs.
fn gone_before_published(child: &CmId) -> bool {
    if child.0.slot.is_live() {
        return false;
    }
    forget(&child.0.fabric.ids, &child.0.key);
    true
}

/// A child checks that its device is not being removed before it joins its listener, and
/// is published (put in the id table) after. A removal that starts in between walks the
/// table without it, so the child checks again once published: if the device is going and
/// the walk did not reach it, it gets its `DeviceRemoval` here, and the removal waits for it
/// too. It is called before the request is queued, so that the request is never taken
/// after the listener's removal: the child's queue then takes nothing but the removal, as
/// unread requests go when their device does (Linux bug 3's test), so the application may
/// see only the removal of an id it never heard of. Both sides decide
/// under the child's state lock, and the walk skips ids already marked, so it gets exactly
/// one.
fn removal_after_publish(child: &CmId, dev: &Arc<DeviceInner>) {
    if !dev.removed.load(std::sync::atomic::Ordering::SeqCst) {
        return;
    }
    let mut g = sync::lock(&child.0.st);
    if g.removed || !child.0.slot.is_live() {
        return;
    }
    g.removed = true;
    g.state = State::DeviceRemoval;
    drop(g);
    leave_backlog(&child.0);
    sync::lock(&dev.late_holders).push((child.0.key, child.0.slot.clone()));
    child.0.slot.push_removal(Event::DeviceRemoval);
}

impl Fabric {
    /// Creates an id whose events go to `handler` (one call at a time per id, in order).
    ///
    /// On a provider-backed fabric ([`Fabric::with_provider`]) a creation the provider
    /// refuses gives an id that is already destroyed; [`Fabric::try_create_id`] says why.
    pub fn create_id(
        &self,
        ps: PortSpace,
        handler: impl Fn(&CmId, Event) -> Flow + Send + Sync + 'static,
    ) -> CmId {
        let h: Handler = Arc::new(handler);
        self.finish_create(ps, callback(h))
            .unwrap_or_else(|(id, _)| id)
    }

    /// Creates an id whose events go to `channel`.
    pub fn create_id_on(&self, ps: PortSpace, channel: &EventChannel) -> CmId {
        let ch = channel.0.clone();
        self.finish_create(ps, Target::Channel(ch))
            .unwrap_or_else(|(id, _)| id)
    }

    /// Like [`Fabric::create_id`], reporting a provider's refusal (a limit, a lost daemon).
    pub fn try_create_id(
        &self,
        ps: PortSpace,
        handler: impl Fn(&CmId, Event) -> Flow + Send + Sync + 'static,
    ) -> Result<CmId> {
        let h: Handler = Arc::new(handler);
        self.finish_create(ps, callback(h)).map_err(|(_, e)| e)
    }

    /// Like [`Fabric::create_id_on`], reporting a provider's refusal.
    pub fn try_create_id_on(&self, ps: PortSpace, channel: &EventChannel) -> Result<CmId> {
        self.finish_create(ps, Target::Channel(channel.0.clone()))
            .map_err(|(_, e)| e)
    }

    fn finish_create(
        &self,
        ps: PortSpace,
        target: Target<Event>,
    ) -> std::result::Result<CmId, (CmId, Error)> {
        let id = build(&self.0, ps, target);
        if self.0.shut.load(std::sync::atomic::Ordering::SeqCst) {
            // Never published, no callback can have run: this destroy is immediate.
            let _ = id.0.slot.destroy(true);
            return Err((id, Error::ShutDown));
        }
        if let Some(p) = &self.0.provider {
            match p.create_id(ps, Sink(Arc::downgrade(&id.0))) {
                Ok(r) => {
                    id.0.set_remote(r);
                }
                Err(e) => {
                    // Never published, no callback can have run: this destroy is immediate.
                    let _ = id.0.slot.destroy(true);
                    return Err((id, e));
                }
            }
        }
        if !publish(&id) {
            return Err((id, Error::ShutDown));
        }
        Ok(id)
    }
}

fn pd_limit(ps: PortSpace, op: &str) -> usize {
    let ud = matches!(ps, PortSpace::Udp | PortSpace::Ipoib);
    match (op, ud) {
        ("connect", false) => cma::limits::CONNECT,
        ("connect", true) => cma::limits::CONNECT_UD,
        ("accept", false) => cma::limits::ACCEPT,
        ("accept", true) => cma::limits::ACCEPT_UD,
        ("reject", false) => cma::limits::REJECT,
        _ => cma::limits::REJECT_UD,
    }
}

fn check_pd(ps: PortSpace, op: &str, pd: &[u8]) -> Result<()> {
    let max = pd_limit(ps, op);
    if pd.len() > max {
        return Err(Error::PrivateDataTooLong { len: pd.len(), max });
    }
    Ok(())
}

/// Linux `cma_acquire_dev_by_src_ip`: the IPOIB port space needs an InfiniBand device, and
/// rcm's devices are RoCEv2 and iWARP.
fn check_ipoib(ps: PortSpace) -> Result<()> {
    if ps == PortSpace::Ipoib {
        return Err(Error::InvalidArgument(
            "the IPOIB port space needs an InfiniBand device".into(),
        ));
    }
    Ok(())
}

/// Whether a device on `src` can reach `dst`: a loopback address reaches only loopback
/// addresses (a packet from 127.0.0.1 to another host is a martian; the kernel refuses to
/// route it).
fn reaches(src: IpAddr, dst: IpAddr) -> bool {
    !src.is_loopback() || dst.is_loopback()
}

/// Why a call found its id gone at its end: destroyed, or (not destroyed: its
/// DEVICE_REMOVAL to come, its destroy still the application's) its device removed.
fn gone(g: &IdState) -> Error {
    if g.state == State::Destroying {
        Error::Destroyed
    } else {
        Error::DeviceRemoved
    }
}

fn is_ud(ps: PortSpace) -> bool {
    matches!(ps, PortSpace::Udp | PortSpace::Ipoib)
}

impl CmId {
    /// A stable number naming this id (for logs and device-removal reports).
    pub fn key(&self) -> u64 {
        self.0.key
    }

    /// The port space.
    pub fn port_space(&self) -> PortSpace {
        self.0.ps
    }

    /// The current state. For an id a daemon holds ([`CmId::is_remote`]) this, like
    /// [`CmId::local_addr`], [`CmId::peer_addr`] and [`CmId::device_addr`], is a query
    /// to the daemon (a call, about a microsecond through a mapped channel): keep it out of
    /// loops over many ids. A destroyed id answers `Destroying` without asking.
    pub fn state(&self) -> State {
        if !self.0.slot.is_live() {
            return State::Destroying;
        }
        if self.0.remote().is_some() {
            return match self.remote_info() {
                Ok(i) => i.state,
                Err(_) => State::DeviceRemoval,
            };
        }
        sync::lock(&self.0.st).state
    }

    /// The local address and port, once bound.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        if self.0.remote().is_some() {
            return self.remote_info().ok().and_then(|i| i.local);
        }
        sync::lock(&self.0.st).src
    }

    /// The peer's address and port, once known.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        if self.0.remote().is_some() {
            return self.remote_info().ok().and_then(|i| i.peer);
        }
        sync::lock(&self.0.st).dst
    }

    /// The address of the device the id is bound to.
    pub fn device_addr(&self) -> Option<IpAddr> {
        if self.0.remote().is_some() {
            return self.remote_info().ok().and_then(|i| i.device);
        }
        sync::lock(&self.0.st).device.as_ref().map(|d| d.ip)
    }

    /// Whether a provider in another process owns this id (see [`crate::remote`]).
    pub fn is_remote(&self) -> bool {
        self.0.remote().is_some()
    }

    fn remote_info(&self) -> Result<IdInfo> {
        match self.forward(|| Op::Query) {
            Some(Ok(Reply::Info(i))) => Ok(i),
            Some(Err(e)) => Err(e),
            _ => Err(Error::Remote("unexpected reply to a query".into())),
        }
    }

    /// For an id a provider owns: checks it is usable here, then carries `op` out there.
    fn forward(&self, op: impl FnOnce() -> Op) -> Option<Result<Reply>> {
        let r = self.0.remote()?;
        if !self.0.slot.is_live() {
            return Some(Err(Error::Destroyed));
        }
        if sync::lock(&self.0.st).removed {
            return Some(Err(Error::DeviceRemoved));
        }
        crate::device::set_remote_poll_hint(&**r);
        Some(r.call(op()))
    }

    /// Carries out one operation ([`Op`]): the same as calling the method it names. This is
    /// how a provider (the `rcm daemon`) serves its clients.
    pub fn call(&self, op: Op) -> Result<Reply> {
        let done = |r: Result<()>| r.map(|()| Reply::Done);
        match op {
            Op::SetReuseaddr(b) => done(self.set_reuseaddr(b)),
            Op::Bind(a) => done(self.bind(a)),
            Op::ResolveAddr { src, dst } => done(self.resolve_addr(src, dst)),
            Op::ResolveRoute => done(self.resolve_route()),
            Op::Listen(b) => done(self.listen(b)),
            Op::CreateQp => self.create_qp().map(Reply::Qpn),
            Op::DestroyQp => done(self.destroy_qp()),
            Op::Connect(o) => done(self.connect(&o)),
            Op::Accept(o) => done(self.accept(&o)),
            Op::Reject(pd) => done(self.reject(&pd)),
            Op::Establish => done(self.establish()),
            Op::NotifyEstablished => done(self.notify_established()),
            Op::Disconnect => done(self.disconnect()),
            Op::InitQpAttr(s) => self.init_qp_attr(s).map(Reply::QpAttr),
            Op::Query => {
                if self.0.remote().is_some() {
                    return self.remote_info().map(Reply::Info);
                }
                if !self.0.slot.is_live() {
                    return Err(Error::Destroyed);
                }
                let g = sync::lock(&self.0.st);
                Ok(Reply::Info(IdInfo {
                    state: g.state,
                    local: g.src,
                    peer: g.dst,
                    device: g.device.as_ref().map(|d| d.ip),
                }))
            }
        }
    }

    /// Attaches a context value; it is dropped exactly once, after the id's last callback.
    /// Set once the id's teardown took its context, it is dropped at once (kept, it would
    /// never be: if it holds this `CmId`, the two would keep each other alive). A value
    /// replaced while a [`with_context`](Self::with_context) closure borrows it is dropped
    /// when that closure returns.
    pub fn set_context(&self, ctx: impl Any + Send + Sync) {
        let new: Arc<dyn Any + Send + Sync> = Arc::new(ctx);
        let old = {
            let mut g = sync::lock(&self.0.st);
            if g.state == State::Destroying {
                Some(new)
            } else {
                g.context.replace(new)
            }
        };
        // Dropped with no lock held: the user's drop may call into rcm (or drop the last
        // handle of the fabric, which then shuts down and tears this id down).
        drop(old);
    }

    /// `rdma_set_reuseaddr`: lets this id share its port with other reusing ids, as long as
    /// none of them listens (listening clears it). Turning it on is allowed in any state but
    /// Listen, on a bound id too, whose binding becomes shareable at once; turning it off only
    /// before the id is bound (Linux's rule).
    pub fn set_reuseaddr(&self, reuse: bool) -> Result<()> {
        if let Some(r) = self.forward(|| Op::SetReuseaddr(reuse)) {
            return r.map(drop);
        }
        let _op = sync::lock(&self.0.op);
        let mut g = self.usable()?;
        let allowed = if reuse {
            g.state != State::Listen
        } else {
            g.state == State::Idle
        };
        if !allowed {
            return Err(Error::InvalidState(g.state));
        }
        g.reuse = reuse;
        if let (true, true, Some(src)) = (reuse, g.bound, g.src) {
            sync::lock(&self.0.fabric.ports).set_reuse(self.0.ps, src, self.0.key);
        }
        Ok(())
    }

    /// Runs `f` on the context, if it is a `T`. No lock of the id is held while `f` runs:
    /// it may call the id (even `set_context`, `with_context` or `destroy`). A destroy
    /// elsewhere does not drop the context under `f`: the last of the closures borrowing it
    /// drops it when it returns. A blocking destroy made where it may wait (not inside a
    /// callback, a context borrow or a teardown, nor on one of rcm's threads) returns only
    /// after that; any other destroy does not wait for `f` (waiting there could wait for
    /// itself, or for a thread that waits for it), nor does the future of
    /// [`begin_destroy`](Self::begin_destroy). A destroy from inside `f` returns `Done` when
    /// it could tear the id down at once, `Deferred` otherwise.
    pub fn with_context<T: 'static, R>(&self, f: impl FnOnce(&T) -> R) -> Option<R> {
        let ctx = sync::lock(&self.0.st).context.clone()?;
        let reading = ContextRead {
            _frame: crate::slot::Borrow::enter(&self.0.slot, ctx_addr(&ctx)),
            ctx: Some(ctx),
        };
        reading
            .ctx
            .as_deref()
            .and_then(|c| c.downcast_ref::<T>())
            .map(f)
    }

    /// Locks the state after checking the id is usable.
    fn usable(&self) -> Result<std::sync::MutexGuard<'_, IdState>> {
        if !self.0.slot.is_live() {
            return Err(Error::Destroyed);
        }
        let g = sync::lock(&self.0.st);
        if g.removed {
            return Err(Error::DeviceRemoved);
        }
        Ok(g)
    }

    /// Binds to a local address (`rdma_bind_addr`). Port 0 picks an ephemeral port; an
    /// unspecified IP binds every device. Idle → AddrBound.
    pub fn bind(&self, addr: SocketAddr) -> Result<()> {
        if let Some(r) = self.forward(|| Op::Bind(addr)) {
            return r.map(drop);
        }
        let _op = sync::lock(&self.0.op);
        let mut g = self.usable()?;
        if g.state != State::Idle {
            return Err(Error::InvalidState(g.state));
        }
        let device = if addr.ip().is_unspecified() {
            None
        } else {
            let d = self
                .0
                .fabric
                .device(addr.ip())
                .ok_or(Error::AddrNotAvailable(addr.ip()))?;
            check_ipoib(self.0.ps)?;
            Some(d)
        };
        let bound =
            sync::lock(&self.0.fabric.ports).bind_with(self.0.ps, addr, self.0.key, g.reuse)?;
        g.src = Some(bound);
        g.bound = true;
        g.device = device;
        g.state = State::AddrBound;
        Ok(())
    }

    /// Picks the device that reaches `dst` (`rdma_resolve_addr`): the bound device, or `src`'s,
    /// or one of the same family (another device first, then `dst`'s own). Binds an
    /// ephemeral port if unbound; on a bound id `src` is ignored, as Linux ignores it (a
    /// wildcard binding takes the device the route picks). Reports `AddrResolved` or
    /// `AddrError`; a failure changes nothing.
    ///
    /// As in Linux, what the call can judge at once fails the call with no event: a
    /// destination of another family than the bound address (`InvalidArgument`: Linux's
    /// `resolve_prepare_src` -EINVAL), a `src` no device has (`AddrNotAvailable`: Linux binds
    /// `src` first), or, with a `src`, the IPOIB port space. What resolution finds is an
    /// `AddrError` event: no device of the destination's family, a loopback device for a
    /// destination off this host (a loopback source reaches only loopback addresses, as
    /// Linux's routing refuses a martian source), the IPOIB port space (InfiniBand only).
    pub fn resolve_addr(&self, src: Option<IpAddr>, dst: SocketAddr) -> Result<()> {
        if let Some(r) = self.forward(|| Op::ResolveAddr { src, dst }) {
            return r.map(drop);
        }
        let _op = sync::lock(&self.0.op);
        let mut g = self.usable()?;
        if !matches!(g.state, State::Idle | State::AddrBound) {
            return Err(Error::InvalidState(g.state));
        }
        // An unspecified source is no source (cma_bind_addr binds the wildcard then). On a
        // bound id none is: Linux's `resolve_prepare_src` binds only an idle id ("a
        // previously bound ID will not be re-bound and src_addr is ignored"), and the route
        // to the destination picks the device of a wildcard binding.
        let src = src.filter(|s| !s.is_unspecified() && !g.bound);
        let family = |ip: IpAddr| ip.is_ipv4();
        let fab = &self.0.fabric;
        if let Some(b) = g.src.filter(|_| g.bound) {
            if b.is_ipv4() != dst.is_ipv4() {
                return Err(Error::InvalidArgument(
                    "the destination is of another family than the bound address".into(),
                ));
            }
        }
        let chosen = match (&g.device, src) {
            (Some(d), _) => Some(d.clone()),
            (None, Some(s)) => {
                let d = fab.device(s);
                // Unbound: Linux binds `src` first, and that bind fails at once.
                if !g.bound {
                    if family(s) != dst.is_ipv4() {
                        return Err(Error::InvalidArgument(
                            "the source and the destination are of different families".into(),
                        ));
                    }
                    if d.is_none() {
                        return Err(Error::AddrNotAvailable(s));
                    }
                    check_ipoib(self.0.ps)?;
                }
                d
            }
            (None, None) => {
                let devs = fab.devices();
                let fits = |d: &&Arc<DeviceInner>| family(d.ip) == dst.is_ipv4();
                devs.iter()
                    .filter(fits)
                    .find(|d| d.ip != dst.ip() && reaches(d.ip, dst.ip()))
                    .or_else(|| devs.iter().find(|d| d.ip == dst.ip()))
                    .or_else(|| devs.iter().find(fits))
                    .cloned()
            }
        };
        let resolved = match chosen {
            // An IPv4 host written as IPv6: no IPv6 route goes there (Linux's
            // `rdma_resolve_addr` fails it the same way), and a REQ sent to it would leave as
            // IPv4 with an IPv6 ICRC and header. The IPv4 address reaches it.
            _ if matches!(dst.ip(), IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some()) => {
                Err(Error::AddrNotAvailable(dst.ip()))
            }
            None => Err(Error::AddrNotAvailable(src.unwrap_or(dst.ip()))),
            Some(d) if family(d.ip) != dst.is_ipv4() || !reaches(d.ip, dst.ip()) => {
                Err(Error::AddrNotAvailable(dst.ip()))
            }
            Some(d) => check_ipoib(self.0.ps).map(|()| d),
        };
        let dev = match resolved {
            Ok(d) => d,
            Err(e) => {
                drop(g);
                self.0.slot.push(Event::AddrError(e));
                return Ok(());
            }
        };
        let src_addr = if g.bound {
            let b = g.src.unwrap_or_else(|| SocketAddr::new(dev.ip, 0));
            SocketAddr::new(dev.ip, b.port())
        } else {
            let b = sync::lock(&fab.ports).bind_with(
                self.0.ps,
                SocketAddr::new(dev.ip, 0),
                self.0.key,
                g.reuse,
            )?;
            g.bound = true;
            b
        };
        // Rebind the port to the concrete device address when it was a wildcard, with the
        // id's reuse setting. Where that address's port is taken (by an id that reuses it,
        // while this one does not) the wildcard binding stays and the call fails, changing
        // nothing: an id must never believe itself bound to a port it does not hold.
        if let Some(old) = g.src {
            if old.ip() != src_addr.ip() {
                let mut ports = sync::lock(&fab.ports);
                ports.release(self.0.ps, old, self.0.key);
                if let Err(e) = ports.bind_with(self.0.ps, src_addr, self.0.key, g.reuse) {
                    // Just released under this lock: taking it back cannot fail.
                    let _ = ports.bind_with(self.0.ps, old, self.0.key, g.reuse);
                    return Err(e);
                }
            }
        }
        g.src = Some(src_addr);
        g.dst = Some(dst);
        g.device = Some(dev);
        g.state = State::AddrResolved;
        drop(g);
        self.0.slot.push(Event::AddrResolved);
        Ok(())
    }

    /// Builds the RoCE path locally as rdma_cm does (`rdma_resolve_route`): no SA; flow label
    /// from the ports, hop limit 64, packet lifetime 18. AddrResolved → RouteResolved.
    pub fn resolve_route(&self) -> Result<()> {
        if let Some(r) = self.forward(|| Op::ResolveRoute) {
            return r.map(drop);
        }
        let _op = sync::lock(&self.0.op);
        let mut g = self.usable()?;
        if g.state != State::AddrResolved {
            return Err(Error::InvalidState(g.state));
        }
        let (Some(src), Some(dst)) = (g.src, g.dst) else {
            return Err(Error::InvalidState(g.state));
        };
        let loopback = src.ip().is_loopback();
        // iWARP has no path to build: TCP routes (Linux's iWARP route resolution is a no-op
        // work item).
        let iwarp = g.device.as_ref().is_some_and(|d| d.is_iwarp());
        g.path = if iwarp {
            PathParams::default()
        } else {
            PathParams {
                flow_label: (u32::from(src.port()) * 31 + u32::from(dst.port())) & 0xF_FFFF,
                hop_limit: 64,
                mtu: if loopback { 5 } else { 3 },
                ..PathParams::default()
            }
        };
        g.state = State::RouteResolved;
        drop(g);
        self.0.slot.push(Event::RouteResolved);
        Ok(())
    }

    /// Listens (`rdma_listen`): on the bound device, or on every device (present and future)
    /// for a wildcard address. AddrBound (or Idle, binding the wildcard) → Listen. `backlog`
    /// bounds connect requests not yet answered (0: the default, 256).
    pub fn listen(&self, backlog: usize) -> Result<()> {
        if let Some(r) = self.forward(|| Op::Listen(backlog)) {
            return r.map(drop);
        }
        // A wildcard listen and a device being added must not miss each other. Taken before
        // the id's `op`, as `Fabric::add_device` does (it takes each wildcard listener's `op`
        // under it): the other order deadlocked a listen called again on a wildcard listener
        // against a device being added.
        let _devices = sync::lock(&self.0.fabric.listen_lock);
        let _op = sync::lock(&self.0.op);
        let (src, devices, implicit) = {
            let g = self.usable()?;
            let (src, implicit) = match g.state {
                State::AddrBound => (g.src.ok_or(Error::InvalidState(g.state))?, false),
                State::Idle => (SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0), true),
                s => return Err(Error::InvalidState(s)),
            };
            let devices = if src.ip().is_unspecified() {
                self.0
                    .fabric
                    .devices()
                    .into_iter()
                    .filter(|d| d.ip.is_ipv4() == src.is_ipv4() || src.is_ipv6())
                    // iWARP carries only the TCP port space (as rdma_cm on iWARP).
                    .filter(|d| !d.is_iwarp() || self.0.ps == PortSpace::Tcp)
                    .collect()
            } else {
                g.device.clone().into_iter().collect::<Vec<_>>()
            };
            (src, devices, implicit)
        };
        // rdma_listen on an unbound id binds the wildcard first.
        let src = if implicit {
            sync::lock(&self.0.fabric.ports).bind(self.0.ps, src, self.0.key)?
        } else {
            src
        };
        let wildcard = src.ip().is_unspecified();
        let sid = cma::service_id(self.0.ps, src.port());
        let mut done = Vec::new();
        let unwind = |done: Vec<(Arc<DeviceInner>, u64)>| {
            for (d, sid) in done {
                unregister_listen(&d, sid, &self.0);
            }
            if implicit {
                sync::lock(&self.0.fabric.ports).release(self.0.ps, src, self.0.key);
            }
        };
        for d in devices {
            match register_listen(&d, sid, backlog, Arc::downgrade(&self.0)) {
                Ok(()) => done.push((d, sid)),
                Err(e) => {
                    // Unwind what this call did: a failure changes nothing.
                    unwind(done);
                    return Err(e);
                }
            }
        }
        let mut g = sync::lock(&self.0.st);
        if g.state == State::Destroying || g.removed {
            let e = gone(&g);
            drop(g);
            unwind(done);
            return Err(e);
        }
        // A listener shares its port with nobody (reuse ends here, as in Linux).
        // The port table's lock is let go before the unwinding: held there (as the guard of
        // an `if let` scrutinee is, to the end of its body), it would be held through the
        // engine calls that end the listens, whose routing takes other ids' state locks,
        // which are taken before it everywhere else.
        let taken = sync::lock(&self.0.fabric.ports).listen(self.0.ps, src, self.0.key);
        if let Err(e) = taken {
            drop(g);
            unwind(done);
            return Err(e);
        }
        if implicit {
            g.src = Some(src);
            g.bound = true;
        }
        // A device removed since it was listed: its removal's walk of the ids may have
        // passed this one before it listened. Read under this lock, which that walk reads
        // the listens under (one of the two sees the other), and let go here.
        let (on, removed): (Vec<_>, Vec<_>) = done
            .into_iter()
            .partition(|(d, _)| !d.removed.load(std::sync::atomic::Ordering::SeqCst));
        let l = g.listening.get_or_insert_with(Box::default);
        l.on = on;
        l.wildcard = wildcard;
        l.backlog = backlog;
        g.state = State::Listen;
        drop(g);
        for (d, sid) in removed {
            unregister_listen(&d, sid, &self.0);
        }
        if wildcard {
            let mut ws = sync::lock(&self.0.fabric.wildcard_listeners);
            ws.push(Arc::downgrade(&self.0));
            // A destroy whose teardown already looked for it would leave it for good.
            if !self.0.slot.is_live() {
                ws.retain(|w| w.upgrade().is_some_and(|x| !Arc::ptr_eq(&x, &self.0)));
            }
        }
        Ok(())
    }

    /// Attaches a soft QP; returns its number.
    pub fn create_qp(&self) -> Result<u32> {
        if let Some(r) = self.forward(|| Op::CreateQp) {
            return match r? {
                Reply::Qpn(n) => Ok(n),
                _ => Err(Error::Remote("unexpected reply to create_qp".into())),
            };
        }
        let _op = sync::lock(&self.0.op);
        let mut g = self.usable()?;
        if g.qp.is_some() {
            return Err(Error::QpBusy("the id already has a QP".into()));
        }
        let qpn = self.0.fabric.new_qpn();
        g.qp = Some(SoftQp { qpn, in_use: false });
        Ok(qpn)
    }

    /// Destroys the attached QP (`rdma_destroy_qp`): the id has no QP from here on, as
    /// Linux sets `id->qp` to NULL. A connect or accept after it goes without one (its QPN
    /// from the options, or a fresh one), a REP still to come is reported as
    /// `ConnectResponse` and waits for [`CmId::establish`] (the RTU the QP's connect would
    /// have had sent at once is not), a UD id receives nothing more on the QP's number, and
    /// [`CmId::create_qp`] may attach a new QP.
    pub fn destroy_qp(&self) -> Result<()> {
        if let Some(r) = self.forward(|| Op::DestroyQp) {
            return r.map(drop);
        }
        let (dev, cep, ud) = {
            let mut g = sync::lock(&self.0.st);
            let qp = g.qp.take().ok_or(Error::QpBusy("no QP attached".into()))?;
            let used = g.conn.local_qpn == qp.qpn;
            if used {
                // A connection went by its number: the id keeps it until its teardown.
                let old = std::mem::replace(&mut g.leased_qpn, qp.qpn);
                if old != 0 {
                    self.0.fabric.give_back_qpn(old);
                }
            } else {
                self.0.fabric.give_back_qpn(qp.qpn);
            }
            let ud = is_ud(self.0.ps);
            // A connect whose REP has not come: its RTU waits for `establish` now.
            let connecting = !ud && qp.in_use && g.state == State::Connect;
            (
                g.device.clone(),
                g.cep.filter(|_| connecting),
                (ud && used).then_some(qp.qpn),
            )
        };
        // A UD QP receives nothing from here on, as a destroyed QP does.
        if let (Some(dev), Some(qpn)) = (&dev, ud) {
            unregister_ud(dev, qpn, &self.0);
        }
        // A REP handled before this reaches the engine had its RTU sent: the id then
        // reports ESTABLISHED all the same (see `on_engine_event`).
        if let (Some(dev), Some(cep)) = (&dev, cep) {
            dev.with_engine(|ep, _| {
                let _ = ep.leave_rtu_to_caller(cep);
            });
        }
        Ok(())
    }

    /// Takes the QP for a connect/accept: not already in use.
    fn claim_qp(g: &mut IdState, fallback: Option<u32>, fabric: &FabricInner) -> Result<u32> {
        match &mut g.qp {
            Some(q) => {
                if q.in_use {
                    return Err(Error::QpBusy("the QP is already connected".into()));
                }
                q.in_use = true;
                Ok(q.qpn)
            }
            // A caller's QPN goes on the wire in 24 bits and names the id's UD receive queue:
            // 0 and 1 are the special QPs, and a wider value would be announced truncated
            // (another id's QPN, whose datagrams this id would then be sent).
            None => match fallback {
                Some(q) if !(2..=0xFF_FFFF).contains(&q) => Err(Error::InvalidArgument(
                    format!("QPN {q:#x}: a QP number is 24 bits, and 0 and 1 are the special QPs")
                        .into(),
                )),
                Some(q) => Ok(q),
                // Held until the teardown; a connect retried after a failure goes by the
                // same one.
                None => {
                    if g.leased_qpn == 0 {
                        g.leased_qpn = fabric.new_qpn();
                    }
                    Ok(g.leased_qpn)
                }
            },
        }
    }

    fn unclaim_qp(g: &mut IdState) {
        if let Some(qp) = &mut g.qp {
            qp.in_use = false;
        }
    }

    /// Connects (`rdma_connect`): a REQ (RC) or SIDR_REQ (UD) with rdma_cm's header.
    /// RouteResolved → Connect. With a QP attached ([`CmId::create_qp`]) the REP is
    /// answered with the RTU as it is handled and the id reports `Established`, as rdma_cm
    /// does for an id with a QP; without one it reports `ConnectResponse` and waits for
    /// [`CmId::establish`]. A UD id receives datagrams on its QPN from here on
    /// ([`CmId::recv_ud`]); a QPN another live UD id of the device receives on is refused
    /// ([`Error::QpBusy`]).
    ///
    /// On iWARP the TCP stream leaves from the id's rdma_cm address and port, as siw binds
    /// it. Where the kernel has that TCP port taken on the address (another program's
    /// socket, or the same four-tuple in TIME_WAIT), the stream leaves from a port the
    /// kernel picks instead, unlike siw, whose connect then fails: rcm's port space is its
    /// own, so the clash is nothing the caller chose.
    pub fn connect(&self, opts: &ConnectOptions) -> Result<()> {
        if let Some(r) = self.forward(|| Op::Connect(opts.clone())) {
            return r.map(drop);
        }
        let _op = sync::lock(&self.0.op);
        let (dst, dev, qpn, psn, path, pd, attached) = {
            let mut g = self.usable()?;
            if let Some(dev) = g.device.as_ref().filter(|d| d.is_iwarp()).cloned() {
                drop(g);
                return self.iw_connect(&dev, opts);
            }
            let psn = rand::random::<u32>() & 0xFF_FFFF;
            if g.state != State::RouteResolved {
                return Err(Error::InvalidState(g.state));
            }
            check_pd(self.0.ps, "connect", &opts.private_data)?;
            let (Some(src), Some(dst), Some(dev)) = (g.src, g.dst, g.device.clone()) else {
                return Err(Error::InvalidState(g.state));
            };
            let hdr = CmaHdr {
                src_port: src.port(),
                src: src.ip(),
                dst: dst.ip(),
            };
            let max = pd_limit(self.0.ps, "connect");
            let pd = hdr.with_user_data(&opts.private_data, max).map_err(|_| {
                Error::PrivateDataTooLong {
                    len: opts.private_data.len(),
                    max,
                }
            })?;
            let qpn = Self::claim_qp(&mut g, opts.qpn, &self.0.fabric)?;
            // Connect before the REQ can leave: a reply routed during the engine call must
            // find the id connecting. A failure below puts the state back. A UD id receives
            // datagrams on its QPN from here on (its ESTABLISHED may be handled before this
            // call returns). Set under the lock the state was checked under: a destroy in
            // between would otherwise be overwritten, and the endpoint made below, which
            // its teardown never saw, kept (and its REQ retried) for good.
            g.state = State::Connect;
            // What the REQ announces, recorded before it can leave: its REP may be handled
            // (and the QP moved along with these values) before the engine call returns,
            // at once when the peer is an id of this device (`FabricConfig::loopback`), and
            // the REP's own values (the ACK timeout from its ACK delay) must not be
            // overwritten afterwards.
            g.conn.local_qpn = qpn;
            g.conn.local_psn = psn;
            g.conn.retry_count = opts.retry_count.min(7);
            g.conn.rnr_retry_count = opts.rnr_retry_count.min(7);
            g.conn.ack_timeout = ib::cm_ack_timeout(15, g.path.packet_life_time);
            // ib_send_cm_req keeps them until the REP: INIT's access flags follow them.
            g.conn.responder_resources = opts.responder_resources;
            g.conn.initiator_depth = opts.initiator_depth;
            (dst, dev, qpn, psn, g.path, pd, g.qp.is_some())
        };
        if is_ud(self.0.ps) {
            if let Err(e) = register_ud(&dev, qpn, &self.0) {
                let mut g = sync::lock(&self.0.st);
                if g.state == State::Connect {
                    g.state = State::RouteResolved;
                }
                g.conn.local_qpn = 0;
                Self::unclaim_qp(&mut g);
                return Err(e);
            }
        }
        let sid = cma::service_id(self.0.ps, dst.port());
        let weak = Arc::downgrade(&self.0);
        let mut p = ConnectParams::new(dst.ip(), sid, qpn);
        p.responder_resources = opts.responder_resources;
        p.initiator_depth = opts.initiator_depth;
        p.retry_count = opts.retry_count.min(7);
        p.rnr_retry_count = opts.rnr_retry_count.min(7);
        p.path = path;
        p.starting_psn = Some(psn);
        // A QP attached: the engine sends the RTU when the REP comes, as rdma_cm does for
        // one (see `on_engine_event`), not a second engine call from the REP's routing.
        p.establish_on_rep = attached;
        let r = if is_ud(self.0.ps) {
            let sp = SidrParams {
                dst: dst.ip(),
                service_id: sid,
                private_data: pd,
                timeout: 20,
                max_retries: 15,
            };
            dev.with_engine(|ep, now| {
                let h = ep.sidr_request(now, &sp)?;
                sync::lock(&dev.ceps).insert(h, weak);
                Ok::<_, ib::CmError>(h)
            })
        } else {
            p.private_data = pd;
            dev.with_engine(|ep, now| {
                let h = ep.connect(now, &p)?;
                sync::lock(&dev.ceps).insert(h, weak);
                Ok::<_, ib::CmError>(h)
            })
        };
        let mut g = sync::lock(&self.0.st);
        match r {
            Ok(h) if g.state == State::Destroying || g.removed => {
                // Destroyed or its device removed meanwhile: the teardown (or the removal's
                // walk) did not see this endpoint; end it here.
                let e = gone(&g);
                drop(g);
                unregister_ud(&dev, qpn, &self.0);
                forget(&dev.ceps, &h);
                dev.with_engine(|ep, now| {
                    let _ = ep.destroy(now, h);
                });
                Err(e)
            }
            Ok(h) => {
                g.cep = Some(h);
                Ok(())
            }
            Err(e) => {
                if g.state == State::Connect {
                    g.state = State::RouteResolved;
                }
                g.conn.local_qpn = 0;
                Self::unclaim_qp(&mut g);
                drop(g);
                unregister_ud(&dev, qpn, &self.0);
                Err(e.into())
            }
        }
    }

    /// Accepts a connect request (`rdma_accept`) on the child id: REP (RC) or SIDR_REP (UD).
    /// A UD child receives datagrams on its QPN before the SIDR_REP leaves
    /// ([`CmId::recv_ud`]); a QPN another live UD id of the device receives on is refused
    /// ([`Error::QpBusy`]).
    pub fn accept(&self, opts: &AcceptOptions) -> Result<()> {
        crate::trace::accept_called();
        if let Some(r) = self.forward(|| Op::Accept(opts.clone())) {
            return r.map(drop);
        }
        let _op = sync::lock(&self.0.op);
        let (dev, cep, qpn, psn, req_values) = {
            let mut g = self.usable()?;
            // Asked under the lock the rest is checked under: one look at the id, not two.
            if let Some((dev, key)) = iw_conn_of(&g)? {
                drop(g);
                return self.iw_accept(&dev, key, opts);
            }
            if g.state != State::Connect || g.listener.is_none() || g.conn.accepted {
                return Err(Error::InvalidState(g.state));
            }
            check_pd(self.0.ps, "accept", &opts.private_data)?;
            let (Some(dev), Some(cep)) = (g.device.clone(), g.cep) else {
                return Err(Error::InvalidState(g.state));
            };
            let qpn = Self::claim_qp(&mut g, opts.qpn, &self.0.fabric)?;
            // What the REP announces is what the QP gets (cm.c's ib_send_cm_rep keeps the
            // accept's values for the RTR and RTS attributes). Recorded before the REP can
            // leave: its RTU may be handled, and the ESTABLISHED delivered, before the
            // engine call returns (at once for a peer on this device, `FabricConfig::loopback`).
            g.conn.local_qpn = qpn;
            // The REQ's, back if the accept fails (ib_send_cm_rep keeps the accept's only
            // once the REP is sent).
            let req_values = (g.conn.responder_resources, g.conn.initiator_depth);
            g.conn.responder_resources = opts.responder_resources;
            g.conn.initiator_depth = opts.initiator_depth;
            (dev, cep, qpn, g.conn.local_psn, req_values)
        };
        let unaccepted = |g: &mut IdState| {
            Self::unclaim_qp(g);
            g.conn.local_qpn = 0;
            (g.conn.responder_resources, g.conn.initiator_depth) = req_values;
        };
        if is_ud(self.0.ps) {
            // Receive on the QPN before the SIDR_REP announces it: the peer may send at once.
            if let Err(e) = register_ud(&dev, qpn, &self.0) {
                unaccepted(&mut sync::lock(&self.0.st));
                return Err(e);
            }
        }
        let r = if is_ud(self.0.ps) {
            let p = SidrReplyParams {
                status: SidrStatus::Success,
                qpn,
                qkey: cma::RDMA_UDP_QKEY,
                private_data: opts.private_data.clone(),
            };
            dev.with_engine(|ep, _| ep.sidr_reply(cep, &p))
        } else {
            let p = AcceptParams {
                qpn,
                starting_psn: Some(psn),
                responder_resources: opts.responder_resources,
                initiator_depth: opts.initiator_depth,
                rnr_retry_count: opts.rnr_retry_count.min(7),
                srq: false,
                private_data: opts.private_data.clone(),
            };
            dev.with_engine(|ep, now| ep.accept(now, cep, &p))
        };
        let mut g = sync::lock(&self.0.st);
        match r {
            Ok(()) => {
                g.conn.accepted = true;
                if is_ud(self.0.ps) && g.state == State::Connect {
                    g.state = State::Established;
                }
                Ok(())
            }
            Err(e) => {
                unaccepted(&mut g);
                if is_ud(self.0.ps) {
                    drop(g);
                    unregister_ud(&dev, qpn, &self.0);
                }
                Err(e.into())
            }
        }
    }

    /// Rejects a connect request (`rdma_reject`) with private data: REJ reason 28, or
    /// SIDR_REP status "rejected". Connect → Disconnect. On the active side of an RC
    /// connection it rejects the peer's REP (or, before one came, withdraws the REQ) with a
    /// REJ, as Linux's `rdma_reject` does from ib_cm's REQ_SENT and REP_RCVD (librdmacm
    /// does so itself when it cannot move its QP after a REP); the peer gets `Rejected`.
    /// On the passive side of an RC connection it may also take back an `accept` whose RTU
    /// has not come (ib_cm's REP_SENT: the REJ, then timewait, as cm.c's
    /// `cm_send_rej_locked`); the peer gets `Rejected` with the private data.
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        if let Some(r) = self.forward(|| Op::Reject(private_data.to_vec())) {
            return r.map(drop);
        }
        let _op = sync::lock(&self.0.op);
        if let Some((dev, key)) = self.iw_conn()? {
            return self.iw_reject(&dev, key, private_data);
        }
        let (dev, cep) = {
            let g = self.usable()?;
            let passive = g.listener.is_some();
            // A SIDR request is answered once: accepted, it cannot be rejected.
            let allowed = !is_ud(self.0.ps) || (passive && !g.conn.accepted);
            if g.state != State::Connect || !allowed {
                return Err(Error::InvalidState(g.state));
            }
            check_pd(self.0.ps, "reject", private_data)?;
            let (Some(dev), Some(cep)) = (g.device.clone(), g.cep) else {
                return Err(Error::InvalidState(g.state));
            };
            (dev, cep)
        };
        if is_ud(self.0.ps) {
            let p = SidrReplyParams {
                status: SidrStatus::Rejected,
                private_data: private_data.to_vec(),
                ..Default::default()
            };
            dev.with_engine(|ep, _| ep.sidr_reply(cep, &p))?;
        } else {
            dev.with_engine(|ep, now| {
                ep.reject(now, cep, RejReason::ConsumerDefined, &[], private_data)
            })?;
        }
        let mut g = sync::lock(&self.0.st);
        if g.state == State::Connect {
            g.state = State::Disconnect;
        }
        Ok(())
    }

    /// Sends the RTU after a `ConnectResponse` (`rdma_establish`, active side without a QP).
    pub fn establish(&self) -> Result<()> {
        if let Some(r) = self.forward(|| Op::Establish) {
            return r.map(drop);
        }
        let _op = sync::lock(&self.0.op);
        if self.iw_conn()?.is_some() {
            // iWARP has no RTU: the MPA Reply establishes the connection by itself.
            return Err(Error::InvalidState(sync::lock(&self.0.st).state));
        }
        let (dev, cep) = {
            let g = self.usable()?;
            if g.state != State::Connect || g.listener.is_some() {
                return Err(Error::InvalidState(g.state));
            }
            let (Some(dev), Some(cep)) = (g.device.clone(), g.cep) else {
                return Err(Error::InvalidState(g.state));
            };
            (dev, cep)
        };
        dev.with_engine(|ep, _| ep.establish(cep))?;
        Ok(())
    }

    /// `rdma_notify(id, IB_EVENT_COMM_EST)`: the application's QP received the peer's data
    /// before the RTU came (the RTU was lost or is late), so the connection is up. On the
    /// passive side of a RoCE connection that accepted (Connect, REP sent): the id becomes
    /// Established at once, `Established` is delivered, the REP is no longer retried, and the
    /// RTU, when it comes, changes nothing. Already established: `InvalidState(Established)`
    /// (Linux: -EISCONN); before `accept`, on the active side or on a UD id:
    /// `InvalidState`. On iWARP it does nothing and succeeds, as in Linux: the MPA exchange
    /// has no RTU.
    pub fn notify_established(&self) -> Result<()> {
        if let Some(r) = self.forward(|| Op::NotifyEstablished) {
            return r.map(drop);
        }
        let _op = sync::lock(&self.0.op);
        if self.iw_conn()?.is_some() {
            return Ok(());
        }
        let (dev, cep) = {
            let g = self.usable()?;
            if g.state != State::Connect || g.listener.is_none() || is_ud(self.0.ps) {
                return Err(Error::InvalidState(g.state));
            }
            let (Some(dev), Some(cep)) = (g.device.clone(), g.cep) else {
                return Err(Error::InvalidState(g.state));
            };
            (dev, cep)
        };
        // The engine's state names are not the id's: say it in the id's terms (the RTU may
        // have come just now, its event not yet delivered).
        dev.with_engine(|ep, _| ep.notify_established(cep))
            .map_err(|e| match e {
                rcm_proto::ib::CmError::InvalidState(ib::State::Established) => {
                    Error::InvalidState(State::Established)
                }
                rcm_proto::ib::CmError::InvalidState(_) => Error::InvalidState(State::Connect),
                e => e.into(),
            })
    }

    /// Disconnects (`rdma_disconnect`): DREQ. Established → Disconnect; `Disconnected`
    /// follows. On a connection already going down (the peer's DREQ was answered, or this
    /// side disconnected before) it does nothing and succeeds, as `rdma_disconnect` does.
    /// On a RoCE connection still being set up (REQ sent, or a request received or
    /// accepted and no RTU yet) it fails with `InvalidState(Connect)`, deliberately unlike
    /// Linux: there `rdma_disconnect` returns 0 having only moved the QP to ERR (ib_cm sends
    /// a DREQ only once established), the attempt goes on, and no DISCONNECTED ever comes
    /// for a caller to wait for. To abandon an attempt, destroy the id (or `reject` it).
    /// On iWARP, where Linux closes such a connection once it is up, rcm does the same.
    pub fn disconnect(&self) -> Result<()> {
        if let Some(r) = self.forward(|| Op::Disconnect) {
            return r.map(drop);
        }
        let _op = sync::lock(&self.0.op);
        if let Some((dev, key)) = self.iw_conn()? {
            return self.iw_disconnect(&dev, key);
        }
        let (dev, cep) = {
            let g = self.usable()?;
            // Already going down (either side's disconnect, a DREQ answered): nothing to
            // send, and not an error, as rdma_disconnect returns 0 there.
            if g.state == State::Disconnect && !is_ud(self.0.ps) {
                return Ok(());
            }
            if g.state != State::Established || is_ud(self.0.ps) {
                return Err(Error::InvalidState(g.state));
            }
            let (Some(dev), Some(cep)) = (g.device.clone(), g.cep) else {
                return Err(Error::InvalidState(g.state));
            };
            (dev, cep)
        };
        match dev.with_engine(|ep, now| ep.disconnect(now, cep, &[])) {
            Ok(()) => {}
            // The peer's DREQ won the race: the connection is already going down (the
            // Disconnected event is on its way), exactly as if we had looked a moment later.
            Err(ib::CmError::InvalidState(_)) => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let mut g = sync::lock(&self.0.st);
        if g.state == State::Established {
            g.state = State::Disconnect;
        }
        Ok(())
    }

    /// The attributes to move the QP to `state` with (`rdma_init_qp_attr`), from what the
    /// two sides negotiated, with the mask of those to apply and the access flags as Linux
    /// gives them (the table at [`QpAttr`]). On iWARP there is no QPN, PSN or path (MPA
    /// carries none): INIT and RTR give the access flags, RTS only the port.
    pub fn init_qp_attr(&self, state: QpState) -> Result<QpAttr> {
        if let Some(r) = self.forward(|| Op::InitQpAttr(state)) {
            return match r? {
                Reply::QpAttr(a) => Ok(a),
                _ => Err(Error::Remote("unexpected reply to init_qp_attr".into())),
            };
        }
        let g = self.usable()?;
        let (Some(src), Some(dst)) = (g.src, g.dst) else {
            return Err(Error::InvalidState(g.state));
        };
        // Whether the CM holds a connection for the id (Linux: a cm_id exists, made by
        // connect or by the peer's request); before that the access flags are "default
        // values", none (cma.c cma_ib_init_qp_attr; rdma_init_qp_attr without iw cm_id).
        let connected = matches!(g.state, State::Connect | State::Established);
        // Once it is going or gone (DREQ, REJ, timeout, close) the CM has no attributes
        // for a connected QP in any state (cm.c cm_init_qp_init_attr, iwcm.c
        // iwcm_init_qp_init_attr: EINVAL); UD's do not depend on a connection.
        if g.state == State::Disconnect && !is_ud(self.0.ps) {
            return Err(Error::InvalidState(g.state));
        }
        // Built for RTS, the latest state, then cut down by `QpAttr::for_state`: which fields
        // each state takes is decided there, once, for in-process ids and daemon clients.
        let mut a = QpAttr {
            qp_state: Some(QpState::Rts),
            port_num: 1,
            ..QpAttr::default()
        };
        let cut = |a: QpAttr| a.for_state(state).unwrap_or(a);
        if is_ud(self.0.ps) {
            a.attr_mask = QpAttr::UD;
            a.qkey = cma::RDMA_UDP_QKEY;
            return Ok(cut(a));
        }
        if g.device.as_ref().is_some_and(|d| d.is_iwarp()) {
            // iwcm.c iwcm_init_qp_init_attr (INIT, RTR): remote write and read; for RTS
            // nothing, rdma_init_qp_attr adds the port.
            if connected {
                a.attr_mask = QpAttr::IW_RTS;
                a.qp_access_flags = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
            } else {
                a.attr_mask = QpAttr::IW_INIT;
            }
            return Ok(cut(a));
        }
        a.attr_mask = QpAttr::RC_RTS;
        if connected {
            // cm.c cm_init_qp_init_attr: remote write, and read and atomics when this side
            // grants responder resources.
            a.qp_access_flags = AccessFlags::REMOTE_WRITE;
            if g.conn.responder_resources > 0 {
                a.qp_access_flags =
                    a.qp_access_flags | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
            }
        }
        if state == QpState::Init {
            return Ok(cut(a));
        }
        if !connected || g.conn.remote_qpn == 0 {
            return Err(Error::InvalidState(g.state));
        }
        a.path_mtu = g.path.mtu;
        a.dest_qp_num = g.conn.remote_qpn;
        // Each side's REQ or REP announces the PSN it expects to receive (cm.c keeps the
        // REQ's and REP's starting PSN as the sender's rq_psn and the receiver's sq_psn;
        // cma.c's rdma_init_qp_attr gives RTR its own seq_num).
        a.rq_psn = g.conn.local_psn;
        a.max_dest_rd_atomic = g.conn.responder_resources;
        // cm.c's cm_init_qp_rtr_attr; rdma_cm changes it only through
        // rdma_set_min_rnr_timer, which rcm does not offer.
        a.min_rnr_timer = 0;
        a.sgid = Gid::from_ip(src.ip());
        a.dgid = Gid::from_ip(dst.ip());
        a.flow_label = g.path.flow_label;
        a.hop_limit = g.path.hop_limit;
        a.traffic_class = g.path.traffic_class;
        a.sq_psn = g.conn.remote_psn;
        a.timeout = g.conn.ack_timeout;
        a.retry_cnt = g.conn.retry_count;
        a.rnr_retry = g.conn.rnr_retry_count;
        a.max_rd_atomic = g.conn.initiator_depth;
        Ok(cut(a))
    }

    /// Moves the id to another event channel (`rdma_migrate_id`). Events not yet taken move
    /// with it, in order; events already held stay valid and ack to this id. A listener's
    /// connect requests not yet taken move too (ucma queues them as the listener's events,
    /// and `ucma_migrate_id` moves them), and so do those arriving meanwhile.
    pub fn migrate(&self, to: &EventChannel) -> Result<()> {
        let g = self.usable()?;
        self.0.slot.migrate(&to.0).map_err(|u| match u {
            crate::slot::Unmoved::NotChannel => {
                Error::InvalidArgument("only channel-mode ids can migrate".into())
            }
            // Destroyed between the liveness check above and the move.
            crate::slot::Unmoved::TornDown => Error::Destroyed,
        })?;
        // A request is queued on its child, which took the listener's channel when it was
        // made. Under the listener's lock, which a child joins it under: a child joined
        // before is among these (its request queued or to come), one joining after takes
        // the listener's channel then (`join_listeners_channel`).
        let kids: Vec<Arc<IdInner>> = g
            .listening
            .as_ref()
            .map(|l| l.children.values().filter_map(Weak::upgrade).collect())
            .unwrap_or_default();
        for k in kids {
            if sync::lock(&k.st).request_unseen {
                k.slot.migrate_unseen(&to.0);
            }
        }
        Ok(())
    }

    /// Destroys the id (`rdma_destroy_id`), blocking until no callback is running and none
    /// ever will, the protocol was driven to a clean end (REJ, DREQ or DREP as the state
    /// needs), and the context was dropped — `Done`. Called from inside a callback (this
    /// id's, or another's, whose in-flight callback it may not wait for) it returns
    /// `Deferred` at once: no further callback starts, and the teardown completes when the
    /// running callback returns. The same from the drop of an id's context or handler (a
    /// teardown), where waiting could wait for itself: two contexts that destroy each
    /// other's id when dropped. With channel events of this id still held it fails with
    /// [`Error::EventsOutstanding`], changing nothing.
    pub fn destroy(&self) -> Result<DestroyOutcome> {
        let ctx = self.context_watch();
        let r = self.0.slot.destroy(true).map_err(Error::EventsOutstanding);
        if matches!(r, Ok(DestroyOutcome::Done)) && may_wait_for_borrows() {
            context_gone(ctx.as_ref(), None);
        }
        r
    }

    /// Destroys without blocking: returns at once with a handle that completes under the same
    /// guarantee as [`CmId::destroy`]. Held channel events delay the completion until acked:
    /// an event of this id that is never acked (its [`ChannelEvent`](crate::ChannelEvent)
    /// kept for good) keeps the destruction from ending, and [`DestroyHandle::wait`] from
    /// returning, for as long (use [`DestroyHandle::wait_for`] where that may happen).
    pub fn begin_destroy(&self) -> DestroyHandle {
        let ctx = self.context_watch();
        let _ = self.0.slot.destroy(false);
        DestroyHandle(self.0.slot.clone(), ctx)
    }

    /// What tells when the context this id holds now is gone (dropped by the teardown, or
    /// by the last `with_context` closure borrowing it).
    fn context_watch(&self) -> Option<Weak<dyn Any + Send + Sync>> {
        sync::lock(&self.0.st).context.as_ref().map(Arc::downgrade)
    }
}

/// Whether the calling thread may wait for `with_context` closures on other threads to
/// return: not from a callback, a context borrow, a teardown or one of rcm's threads. Each
/// of those may be what such a closure waits for (a closure that destroys another id whose
/// callback runs here, or whose own closure destroys this id: each borrow waits for the
/// other), so the wait there could never end.
fn may_wait_for_borrows() -> bool {
    !crate::fabric::own_thread()
        && !crate::slot::in_callback()
        && !crate::slot::in_teardown()
        && crate::slot::borrows(|_, _| true) == 0
}

/// Waits until the context `ctx` watches is dropped (the closures borrowing it returned), up
/// to `until`; whether it is. Polled, backing off to 1 ms: it only waits when a destroy meets
/// a closure running, and a waker would cost every id memory for that rare case.
fn context_gone(ctx: Option<&Weak<dyn Any + Send + Sync>>, until: Option<Instant>) -> bool {
    let Some(ctx) = ctx else { return true };
    let mut nap = std::time::Duration::from_micros(10);
    while ctx.strong_count() > 0 {
        if until.is_some_and(|u| Instant::now() >= u) {
            return false;
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(std::time::Duration::from_millis(1));
    }
    true
}

/// Completion of a non-blocking destroy: wait on it, or `.await` it.
pub struct DestroyHandle(Arc<Slot<Event>>, Option<Weak<dyn Any + Send + Sync>>);

impl DestroyHandle {
    /// Blocks until the id is destroyed and its context dropped (a `with_context` closure
    /// running elsewhere drops it when it returns; see [`CmId::with_context`] for where this
    /// does not wait for that). Inside the id's own callback, or in the drop of any id's
    /// context or handler, it returns at once: the destruction may only end after them.
    /// A channel event of the id held and never acked makes this wait for good (the
    /// destruction ends when the event is acked or dropped).
    pub fn wait(&self) {
        crate::fabric::before_wait();
        self.0.wait_destroyed();
        if self.0.phase() == crate::slot::Phase::Destroyed && may_wait_for_borrows() {
            context_gone(self.1.as_ref(), None);
        }
    }

    /// Blocks up to `d`; returns whether the id is destroyed (and, as [`Self::wait`] waits
    /// for it, its context dropped).
    pub fn wait_for(&self, d: std::time::Duration) -> bool {
        crate::fabric::before_wait();
        let until = rcm_proto::later(Instant::now(), d);
        if !self.0.wait_destroyed_for(d) {
            return false;
        }
        !may_wait_for_borrows() || context_gone(self.1.as_ref(), Some(until))
    }

    /// Whether the id is destroyed.
    pub fn is_done(&self) -> bool {
        self.0.phase() == crate::slot::Phase::Destroyed
    }
}

impl std::future::Future for DestroyHandle {
    type Output = ();
    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        if self.0.poll_destroyed(cx.waker()) {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    }
}

fn register_listen(
    d: &Arc<DeviceInner>,
    sid: u64,
    backlog: usize,
    id: Weak<IdInner>,
) -> Result<()> {
    if d.is_iwarp() {
        return match cma::parse_service_id(sid) {
            Some((PortSpace::Tcp, port)) => d.iw_listen(port, backlog, id),
            _ => Err(Error::InvalidArgument(
                "iWARP devices carry only the TCP port space".into(),
            )),
        };
    }
    let existing = sync::lock(&d.listens).get(&sid).is_some();
    if !existing {
        let h = d.with_engine(|ep, _| ep.listen(sid, u64::MAX, backlog))?;
        sync::lock(&d.listens).entry(sid).or_insert(ServiceListen {
            handle: h,
            ids: Vec::new(),
        });
    }
    let mut l = sync::lock(&d.listens);
    let Some(entry) = l.get_mut(&sid) else {
        return Err(Error::Destroyed);
    };
    entry.ids.push(id);
    Ok(())
}

fn unregister_listen(d: &Arc<DeviceInner>, sid: u64, id: &IdInner) {
    if d.is_iwarp() {
        if let Some((_, port)) = cma::parse_service_id(sid) {
            d.iw_unlisten(port, id);
        }
        return;
    }
    let handle = {
        let mut l = sync::lock(&d.listens);
        let Some(entry) = l.get_mut(&sid) else { return };
        entry.ids.retain(|w| {
            w.upgrade()
                .is_some_and(|x| !std::ptr::eq(Arc::as_ptr(&x), id))
        });
        if entry.ids.is_empty() {
            let h = entry.handle;
            l.remove(&sid);
            Some(h)
        } else {
            None
        }
    };
    if let Some(h) = handle {
        d.with_engine(|ep, now| {
            let _ = ep.destroy(now, h);
        });
    }
}

/// Whether a listener's requests not delivered yet fill its backlog (`default` when it
/// asked for 0).
fn backlog_full(l: Option<&Listening>, default: usize) -> bool {
    l.is_some_and(|l| l.undelivered >= if l.backlog == 0 { default } else { l.backlog })
}

/// A child's request was delivered (or answered, or the child goes): its place in the
/// listener's backlog is free. The child's lock is not held while the listener's is taken.
fn leave_backlog(child: &IdInner) {
    free_backlog_place(sync::lock(&child.st));
}

/// A child's connect request reached the application: no longer unseen, and its
/// backlog place is free. One lock of the child's state on this per-connection path.
fn request_delivered(child: &IdInner) {
    let mut g = sync::lock(&child.st);
    g.request_unseen = false;
    free_backlog_place(g);
}

/// Takes the child's backlog place under its lock `g`, then (that lock released) gives it
/// back to the listener.
fn free_backlog_place(mut g: sync::MutexGuard<'_, IdState>) {
    if !std::mem::take(&mut g.in_backlog) {
        return;
    }
    let listener = g.listener.clone();
    drop(g);
    if let Some(l) = listener.and_then(|w| w.upgrade()) {
        if let Some(li) = sync::lock(&l.st).listening.as_mut() {
            li.undelivered = li.undelivered.saturating_sub(1);
        }
    }
}

/// One `with_context` call running: its clone of the context, released (and, if it is the
/// last, the context dropped) before the borrow ends.
struct ContextRead {
    ctx: Option<Arc<dyn Any + Send + Sync>>,
    _frame: crate::slot::Borrow,
}

impl Drop for ContextRead {
    fn drop(&mut self) {
        drop(self.ctx.take());
    }
}

/// A context's address, naming it among the calling thread's borrows.
fn ctx_addr(c: &Arc<dyn Any + Send + Sync>) -> usize {
    Arc::as_ptr(c).cast::<()>() as usize
}

/// Runs once, when the slot tears down: unpublish, drive the protocol to its end, release
/// port, QP and context.
fn teardown(inner: &Arc<IdInner>) {
    let (dev, cep, listening, src, bound, ctx, listener, iwk, ud_qpn) = {
        let mut g = sync::lock(&inner.st);
        g.state = State::Destroying;
        // The QP numbers it held go back (none is announced from here on).
        if let Some(qp) = g.qp.take() {
            inner.fabric.give_back_qpn(qp.qpn);
        }
        let leased = std::mem::take(&mut g.leased_qpn);
        if leased != 0 {
            inner.fabric.give_back_qpn(leased);
        }
        (
            g.device.clone(),
            g.cep.take(),
            g.listening.take().map(|l| *l).unwrap_or_default(),
            g.src,
            g.bound,
            g.context.take(),
            g.listener.clone(),
            g.iw.take().map(std::num::NonZeroUsize::get),
            Some(g.conn.local_qpn).filter(|&q| q != 0 && is_ud(inner.ps)),
        )
    };
    leave_backlog(inner);
    // A child leaves its listener's list (the list must not grow with every connection).
    if let Some(l) = listener.and_then(|w| w.upgrade()) {
        if let Some(l) = sync::lock(&l.st).listening.as_mut() {
            l.children.remove(&inner.key);
            rcm_proto::room::shrink_map(&mut l.children);
        }
    }
    if let (Some(dev), Some(key)) = (&dev, iwk) {
        iw_destroy(dev, key);
    }
    let mail = inner.mail_if_any();
    // A `recv_message` waiting for this id returns (no message is queued from here on:
    // `on_iw_event` checks liveness under the queue's lock, as `deliver_ud` does).
    if let Some(m) = mail {
        let mut q = m.inbox.lock();
        q.clear();
        m.inbox.wake(q);
    }
    // UD: no datagram is queued to this id from here on (`deliver_ud` checks liveness under
    // the queue's lock, and the slot stopped being live before this teardown began).
    if let (Some(dev), Some(q)) = (&dev, ud_qpn) {
        unregister_ud(dev, q, inner);
    }
    if let Some(m) = mail {
        let mut q = m.ud_inbox.lock();
        q.clear();
        m.ud_inbox.wake(q);
    }
    if let (Some(dev), Some(cep)) = (&dev, cep) {
        forget(&dev.ceps, &cep);
        dev.with_engine(|ep, now| {
            let _ = ep.destroy(now, cep);
        });
    }
    let Listening {
        on: listen,
        wildcard,
        children,
        ..
    } = listening;
    for (d, sid) in listen {
        unregister_listen(&d, sid, inner);
    }
    if wildcard {
        sync::lock(&inner.fabric.wildcard_listeners)
            .retain(|w| w.upgrade().is_some_and(|x| !Arc::ptr_eq(&x, inner)));
    }
    // Connect requests nobody has seen die with their listener (rejected).
    for c in children.values().filter_map(Weak::upgrade) {
        let unseen = sync::lock(&c.st).request_unseen;
        if unseen {
            drop(CmId(c).begin_destroy());
        }
    }
    if let (true, Some(src)) = (bound, src) {
        sync::lock(&inner.fabric.ports).release(inner.ps, src, inner.key);
    }
    if let Some(r) = inner.remote() {
        r.release();
    }
    forget(&inner.fabric.ids, &inner.key);
    // A `with_context` closure running elsewhere holds a clone: the last one drops it.
    drop(ctx);
}

/// An event a provider delivered for an id it owns.
pub(crate) fn remote_event(inner: &Arc<IdInner>, ev: Event) {
    if matches!(ev, Event::DeviceRemoval) {
        {
            let mut g = sync::lock(&inner.st);
            if g.removed {
                return;
            }
            g.removed = true;
            // A teardown begun keeps `Destroying`: a context set after it is dropped, not
            // kept (`set_context` looks for that state), as a local device's removal leaves
            // an id no longer live alone.
            if g.state != State::Destroying {
                g.state = State::DeviceRemoval;
            }
        }
        inner.slot.push_removal(ev);
        return;
    }
    inner.slot.push(ev);
}

/// A child joining its listener (under the listener's lock) takes the channel the listener
/// has now: a `migrate` of the listener since the child was made did not see it.
fn join_listeners_channel(lst: &IdInner, child: &CmId) {
    if let Some(ch) = lst.slot.channel() {
        child.0.slot.migrate_unseen(&ch);
    }
}

/// A connect request a provider delivered on a listener it owns: the child is built,
/// joined to the listener and published before the event is visible (Linux bug 3).
pub(crate) fn remote_connect_request(
    lst: &Arc<IdInner>,
    remote: Arc<dyn RemoteId>,
    private_data: Vec<u8>,
    param: ConnParam,
    ud: bool,
    file: impl FnOnce(&Sink),
) -> Option<Sink> {
    let Some(target) = lst.slot_target() else {
        remote.release();
        return None;
    };
    let child = build(&lst.fabric, lst.ps, target);
    child.0.set_remote(remote);
    {
        let mut g = sync::lock(&child.0.st);
        g.state = State::Connect;
        g.listener = Some(Arc::downgrade(lst));
        g.request_unseen = true;
    }
    {
        let mut g = sync::lock(&lst.st);
        if !lst.slot.is_live() || g.removed {
            drop(g);
            sync::lock(&child.0.st).request_unseen = false;
            // The teardown releases the provider's child: the request is rejected there.
            drop(child.begin_destroy());
            return None;
        }
        g.listening
            .get_or_insert_with(Box::default)
            .children
            .insert(child.0.key, Arc::downgrade(&child.0));
        join_listeners_channel(lst, &child);
    }
    // Refused once the fabric shuts down: the child is then destroyed, and is gone below.
    let _ = publish(&child);
    if gone_before_published(&child) {
        return None;
    }
    let sink = Sink(Arc::downgrade(&child.0));
    file(&sink);
    child.0.slot.push(Event::ConnectRequest {
        listener: CmId(lst.clone()),
        private_data,
        param,
        ud,
    });
    Some(sink)
}

/// What arrived for a listener.
pub(crate) enum Incoming {
    Rc(Box<ib::ReqInfo>),
    Ud {
        service_id: u64,
        private_data: Vec<u8>,
    },
}

/// A REQ or SIDR_REQ arrived for an engine listener: find the rdma_cm listener it is for
/// (matching the cma_hdr's destination address), build the child id completely, publish it,
/// then deliver `ConnectRequest` on it.
pub(crate) fn on_connect_request(
    dev: &Arc<DeviceInner>,
    listener: CepHandle,
    cep: CepHandle,
    inc: Incoming,
) {
    let (sid, pd): (u64, &[u8]) = match &inc {
        Incoming::Rc(info) => (info.service_id, &info.private_data),
        Incoming::Ud {
            service_id,
            private_data,
            ..
        } => (*service_id, private_data),
    };
    let refuse = |dev: &Arc<DeviceInner>| {
        dev.with_engine(|ep, now| match &inc {
            Incoming::Rc(_) => {
                let _ = ep.reject(now, cep, RejReason::ConsumerDefined, &[], &[]);
                let _ = ep.destroy(now, cep);
            }
            Incoming::Ud { .. } => {
                let p = SidrReplyParams {
                    status: SidrStatus::Rejected,
                    ..Default::default()
                };
                let _ = ep.sidr_reply(cep, &p);
                let _ = ep.destroy(now, cep);
            }
        });
    };
    let Ok(hdr) = CmaHdr::parse(pd) else {
        return refuse(dev);
    };
    // The request is for this device's address (cma.c's validate_net_dev; the header's IP
    // version is the device's, cma_match_private_data): a REQ naming another host does not
    // reach a wildcard listener, whose child would take that foreign address as its own.
    if hdr.dst != dev.ip {
        return refuse(dev);
    }
    let candidates: Vec<Arc<IdInner>> = {
        let l = sync::lock(&dev.listens);
        l.get(&sid)
            .filter(|e| e.handle == listener)
            .map(|e| e.ids.iter().filter_map(Weak::upgrade).collect())
            .unwrap_or_default()
    };
    let pick = candidates
        .iter()
        .find(|l| sync::lock(&l.st).src.is_some_and(|s| s.ip() == hdr.dst))
        .or_else(|| {
            candidates.iter().find(|l| {
                sync::lock(&l.st)
                    .src
                    .is_some_and(|s| s.ip().is_unspecified())
            })
        })
        .filter(|l| l.slot.is_live())
        .cloned();
    let Some(lst) = pick else { return refuse(dev) };
    // A REQ for an RC id, a SIDR_REQ for a UD one (cma_ib_check_req_qp_type): otherwise the
    // child could neither accept nor reject it. An IB port space id is RC (librdmacm's
    // rdma_create_id makes only UDP and IPOIB ids UD), so it is turned away from SIDR too.
    let ud_request = matches!(inc, Incoming::Ud { .. });
    if is_ud(lst.ps) != ud_request {
        return refuse(dev);
    }
    let Some(target) = lst.slot_target() else {
        return refuse(dev);
    };
    let Some(local_port) = cma::parse_service_id(sid).map(|(_, p)| p) else {
        return refuse(dev);
    };
    // The child shares the listener's handler or channel, as rdma_cm children do.
    let child = build(&lst.fabric, lst.ps, target);
    let ud = matches!(inc, Incoming::Ud { .. });
    let param = match &inc {
        // From our side (see `ConnParam`): the peer's initiator depth is what we must be
        // able to respond to.
        Incoming::Rc(info) => ConnParam {
            responder_resources: info.initiator_depth,
            initiator_depth: info.responder_resources,
            retry_count: info.retry_count,
            rnr_retry_count: info.rnr_retry_count,
            srq: info.srq,
            qpn: info.remote_qpn,
        },
        Incoming::Ud { .. } => ConnParam::default(),
    };
    {
        let mut g = sync::lock(&child.0.st);
        g.state = State::Connect;
        g.src = Some(SocketAddr::new(hdr.dst, local_port));
        g.dst = Some(SocketAddr::new(hdr.src, hdr.src_port));
        g.device = Some(dev.clone());
        g.cep = Some(cep);
        g.listener = Some(Arc::downgrade(&lst));
        g.request_unseen = true;
        g.in_backlog = true;
        if let Incoming::Rc(info) = &inc {
            g.conn.remote_qpn = info.remote_qpn;
            g.conn.remote_psn = info.starting_psn;
            // Chosen now, not at accept (as cma.c's `seq_num` is at creation): librdmacm's
            // rdma_accept moves the QP to RTR, whose receive PSN this is, before it accepts.
            g.conn.local_psn = rand::random::<u32>() & 0xFF_FFFF;
            g.conn.responder_resources = info.initiator_depth;
            g.conn.initiator_depth = info.responder_resources;
            g.conn.retry_count = info.retry_count;
            g.conn.rnr_retry_count = info.rnr_retry_count;
            g.conn.ack_timeout = info.local_ack_timeout;
            g.path = PathParams {
                flow_label: info.flow_label,
                traffic_class: info.traffic_class,
                hop_limit: info.hop_limit,
                mtu: info.mtu,
                ..PathParams::default()
            };
        }
    }
    // Join the listener while it still listens (its teardown takes the children under the
    // same lock, so a request either is seen by that teardown or refused here), then publish
    // the fully built child and tell the user.
    {
        let mut g = sync::lock(&lst.st);
        // The engine's backlog counts requests not answered yet, and a peer's REJ(TIMEOUT)
        // answers one for it, leaving its child: this one counts those not delivered, as
        // ucma's does, so that a peer repeating REQ and REJ cannot pile up children behind
        // a listener nobody reads. One more is dropped unanswered (-ENOMEM in ucma), the
        // peer's retry to find room; a SIDR request is answered REJECT, as cm.c does.
        let full = backlog_full(g.listening.as_deref(), rcm_proto::ib::DEFAULT_BACKLOG);
        if g.state != State::Listen
            || !lst.slot.is_live()
            || dev.removed.load(std::sync::atomic::Ordering::SeqCst)
            || full
        {
            drop(g);
            let quiet = {
                let mut c = sync::lock(&child.0.st);
                c.request_unseen = false;
                c.in_backlog = false;
                // Answered here, not by the child's teardown.
                full && c.cep.take().is_some()
            };
            if quiet {
                dev.with_engine(|ep, now| {
                    let _ = ep.drop_request(now, cep);
                });
            }
            drop(child.begin_destroy());
            return;
        }
        let l = g.listening.get_or_insert_with(Box::default);
        l.undelivered += 1;
        l.children.insert(child.0.key, Arc::downgrade(&child.0));
        join_listeners_channel(&lst, &child);
    }
    // Fully built (device set): visible to device removal from here on.
    // Refused once the fabric shuts down: the child is then destroyed, and is gone below.
    let _ = publish(&child);
    sync::lock(&dev.ceps).insert(cep, Arc::downgrade(&child.0));
    if gone_before_published(&child) {
        forget(&dev.ceps, &cep);
        return;
    }
    // The request's own buffer, the header taken off the front: no second allocation.
    let mut user_pd = match inc {
        Incoming::Rc(info) => info.private_data,
        Incoming::Ud { private_data, .. } => private_data,
    };
    user_pd.drain(..CMA_HDR_LEN.min(user_pd.len()));
    // Before the request is queued, not after: a removal the walk began without this child
    // must not let the request be taken (by a channel's reader) after its listener's
    // DEVICE_REMOVAL. Marked here, the child's queue takes nothing but the removal.
    removal_after_publish(&child, dev);
    child.0.slot.push(Event::ConnectRequest {
        listener: CmId(lst),
        private_data: user_pd,
        param,
        ud,
    });
}

impl IdInner {
    fn mail(&self) -> &Mail {
        &self.extra.get_or_init(Box::default).mail
    }

    /// The id's messages, if it ever received any.
    fn mail_if_any(&self) -> Option<&Mail> {
        self.extra.get().map(|e| &e.mail)
    }

    /// The provider (another process) that owns this id, if one does: every operation
    /// goes there.
    pub(crate) fn remote(&self) -> Option<&Arc<dyn RemoteId>> {
        self.extra.get()?.remote.get()
    }

    fn set_remote(&self, r: Arc<dyn RemoteId>) {
        let _ = self.extra.get_or_init(Box::default).remote.set(r);
    }

    fn slot_target(&self) -> Option<Target<Event>> {
        self.slot.target_clone()
    }
}

/// What an engine event does to the id it names.
pub(crate) fn on_engine_event(
    id: &Arc<IdInner>,
    dev: &Arc<DeviceInner>,
    h: CepHandle,
    ev: CmEvent,
) {
    enum After {
        None,
        /// Send the RTU for a QP attached after the REQ left; the REP's private data.
        Establish(CepHandle, Vec<u8>),
        Drep(CepHandle),
    }
    let mut after = After::None;
    let mut out: Option<Event> = None;
    {
        let mut g = sync::lock(&id.st);
        // The engine handle comes with the event: `connect` records it only after the REQ
        // is out, and a fast reply may be routed before that.
        let cep = Some(h);
        if g.removed {
            // After DeviceRemoval only destroy is valid: no event, no state change. The
            // protocol still answers a DREQ.
            if matches!(ev, CmEvent::DreqReceived { .. }) {
                drop(g);
                dev.with_engine(|ep, now| {
                    let _ = ep.disconnect(now, h, &[]);
                });
            }
            return;
        }
        if g.state == State::Destroying {
            // The teardown ends this endpoint (a DREQ is answered by the engine's destroy),
            // or, when it began while `connect` was putting the endpoint in place, `connect`
            // does, seeing `Destroying`: a REJ or DREQ routed meanwhile must not hide that
            // state, or the endpoint outlives its id (and a context set then is kept).
            return;
        }
        match ev {
            CmEvent::RepReceived(info) => {
                if g.state == State::Connect {
                    // As the engine does (and Linux's cm_rep_handler): the QP's ACK timeout
                    // from the peer's ACK delay and our path's packet lifetime.
                    g.conn.ack_timeout =
                        ib::cm_ack_timeout(info.target_ack_delay, g.path.packet_life_time);
                    g.conn.remote_qpn = info.remote_qpn;
                    g.conn.remote_psn = info.starting_psn;
                    g.conn.responder_resources = info.initiator_depth;
                    g.conn.initiator_depth = info.responder_resources;
                    // cm_rep_handler: the RTS RNR retry count is the one the REP asks for.
                    g.conn.rnr_retry_count = info.rnr_retry_count;
                    // The RTU out (`info.established`) with no QP left: one destroyed after
                    // the REP reached the engine; the connection is up all the same.
                    if g.qp.is_some() || info.established {
                        // A QP attached at connect: the engine already sent the RTU
                        // (`ConnectParams::establish_on_rep`) and `Established` follows.
                        // One attached after the REQ left is moved along here, the RTU
                        // sent by us.
                        // Either way the ESTABLISHED carries the REP's private data
                        // (cma.c sets the REP's event data on the ESTABLISHED that
                        // `cma_rep_recv` turns the REP into); the engine's own
                        // `Established` that follows then finds the id established.
                        if info.established {
                            g.state = State::Established;
                            out = Some(Event::Established {
                                ud: None,
                                private_data: info.private_data,
                            });
                        } else if let Some(c) = cep {
                            after = After::Establish(c, info.private_data);
                        }
                    } else {
                        out = Some(Event::ConnectResponse {
                            private_data: info.private_data,
                            param: ConnParam {
                                responder_resources: info.initiator_depth,
                                initiator_depth: info.responder_resources,
                                rnr_retry_count: info.rnr_retry_count,
                                srq: info.srq,
                                qpn: info.remote_qpn,
                                ..ConnParam::default()
                            },
                        });
                    }
                }
            }
            CmEvent::Established => {
                if g.state == State::Connect {
                    g.state = State::Established;
                    out = Some(Event::Established {
                        ud: None,
                        private_data: Vec::new(),
                    });
                }
            }
            CmEvent::Rejected {
                reason,
                private_data,
                ..
            } => {
                g.state = State::Disconnect;
                CmId::unclaim_qp(&mut g);
                out = Some(Event::Rejected {
                    reason,
                    private_data,
                });
            }
            CmEvent::TimedOut(what) => {
                g.state = State::Disconnect;
                out = Some(match what {
                    ib::TimedOut::Req | ib::TimedOut::SidrReq => {
                        Event::Unreachable(Unreachable::Timeout)
                    }
                    ib::TimedOut::Rep => Event::Unreachable(Unreachable::RepTimeout),
                    ib::TimedOut::Dreq => {
                        if g.disconnected_reported {
                            return;
                        }
                        g.disconnected_reported = true;
                        Event::Disconnected
                    }
                });
            }
            CmEvent::DreqReceived { .. } => {
                g.state = State::Disconnect;
                if let Some(c) = cep {
                    after = After::Drep(c);
                }
                if !g.disconnected_reported {
                    g.disconnected_reported = true;
                    out = Some(Event::Disconnected);
                }
            }
            CmEvent::DrepReceived => {
                g.state = State::Disconnect;
                if !g.disconnected_reported {
                    g.disconnected_reported = true;
                    out = Some(Event::Disconnected);
                }
            }
            // cma_ib_handler passes TIMEWAIT_EXIT on only in RDMA_CM_DISCONNECT, which only
            // a DREQ, a DREP or a DREQ timeout lead to: each reported DISCONNECTED. After a
            // REJ (a connection rejected after its REP) there is none.
            CmEvent::TimewaitExit if g.disconnected_reported => out = Some(Event::TimewaitExit),
            CmEvent::SidrRepReceived {
                status,
                qpn,
                qkey,
                private_data,
            } => {
                if g.state == State::Connect {
                    out = Some(match status {
                        SidrStatus::Success => {
                            g.state = State::Established;
                            let ud = UdParam { qpn, qkey };
                            g.conn.remote_qpn = qpn;
                            Event::Established {
                                ud: Some(ud),
                                private_data,
                            }
                        }
                        status => {
                            g.state = State::Disconnect;
                            Event::Unreachable(Unreachable::Sidr {
                                status,
                                private_data,
                            })
                        }
                    });
                }
            }
            CmEvent::MraReceived { .. }
            | CmEvent::ReqReceived { .. }
            | CmEvent::SidrReqReceived { .. }
            | CmEvent::TimewaitExit => {}
        }
    }
    match after {
        After::None => {}
        After::Establish(c, private_data) => match dev.with_engine(|ep, _| ep.establish(c)) {
            Ok(()) => {
                // The engine's `Established` is routed after this (events of an engine
                // call made while routing wait their turn); should it have come first,
                // it was the one, without the private data.
                let mut g = sync::lock(&id.st);
                if g.state == State::Connect {
                    g.state = State::Established;
                    drop(g);
                    id.slot.push(Event::Established {
                        ud: None,
                        private_data,
                    });
                }
            }
            Err(e) => id.slot.push(Event::ConnectError(e.into())),
        },
        After::Drep(c) => {
            // Answered at once, where Linux waits for the application's `rdma_disconnect` or
            // destroy (see the crate docs): nothing here is left for the application to do
            // before the DREP (its QP, if any, is its own to flush).
            dev.with_engine(|ep, now| {
                let _ = ep.disconnect(now, c, &[]);
            });
        }
    }
    if let Some(ev) = out {
        id.slot.push(ev);
    }
}

/// A device came up: wildcard listeners start listening on it too.
pub(crate) fn on_device_added(fabric: &Arc<FabricInner>, dev: &Arc<DeviceInner>) {
    let ls: Vec<Arc<IdInner>> = sync::lock(&fabric.wildcard_listeners)
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    for l in ls {
        let _op = sync::lock(&l.op);
        // Read under the state lock, register without it (registering routes events, which
        // takes other ids' state locks), then record under it again.
        let (sid, backlog) = {
            let g = sync::lock(&l.st);
            let Some(src) = g.src else { continue };
            if g.state != State::Listen
                || !l.slot.is_live()
                || (src.is_ipv4() != dev.ip.is_ipv4() && !src.is_ipv6())
                || (dev.is_iwarp() && l.ps != PortSpace::Tcp)
            {
                continue;
            }
            let backlog = g.listening.as_ref().map_or(0, |l| l.backlog);
            (cma::service_id(l.ps, src.port()), backlog)
        };
        if register_listen(dev, sid, backlog, Arc::downgrade(&l)).is_err() {
            continue;
        }
        let mut g = sync::lock(&l.st);
        // A removal of the device that began meanwhile may have walked past this listener
        // (see `listen`): it is checked under the listener's lock.
        if g.state == State::Listen && !dev.removed.load(std::sync::atomic::Ordering::SeqCst) {
            g.listening
                .get_or_insert_with(Box::default)
                .on
                .push((dev.clone(), sid));
        } else {
            drop(g);
            unregister_listen(dev, sid, &l);
        }
    }
}

/// A device is going: its engine listeners stop, and every id bound to it gets one
/// `DeviceRemoval`. Returns those ids (the removal waits for them).
pub(crate) fn on_device_removed(
    fabric: &Arc<FabricInner>,
    dev: &Arc<DeviceInner>,
) -> Vec<(u64, Arc<Slot<Event>>)> {
    let all: Vec<Arc<IdInner>> = sync::lock(&fabric.ids)
        .values()
        .filter_map(Weak::upgrade)
        .collect();
    let mut holders = Vec::new();
    for id in all {
        let mut g = sync::lock(&id.st);
        // Wildcard listeners lose their per-device listen silently (as rdma_cm's internal
        // listen ids are destroyed on removal).
        if let Some(l) = g.listening.as_mut().filter(|l| l.wildcard) {
            let mine: Vec<(Arc<DeviceInner>, u64)> =
                l.on.iter()
                    .filter(|(d, _)| Arc::ptr_eq(d, dev))
                    .cloned()
                    .collect();
            l.on.retain(|(d, _)| !Arc::ptr_eq(d, dev));
            drop(g);
            for (d, sid) in mine {
                unregister_listen(&d, sid, &id);
            }
            continue;
        }
        if !g.device.as_ref().is_some_and(|d| Arc::ptr_eq(d, dev))
            || !id.slot.is_live()
            || g.removed
        {
            continue;
        }
        g.removed = true;
        g.state = State::DeviceRemoval;
        drop(g);
        // The removal replaces a request still queued: it will not be delivered.
        leave_backlog(&id);
        holders.push((id.key, id.slot.clone()));
        id.slot.push_removal(Event::DeviceRemoval);
    }
    holders
}

/// The unspecified address of a family, for binding.
pub fn any_addr(v6: bool, port: u16) -> SocketAddr {
    if v6 {
        SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port)
    } else {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port)
    }
}

// ---------------------------------------------------------------------------------------
// iWARP: the same calls over an `iw::Cep` per TCP stream (see `iwarp.rs`).

/// The largest private data of an MPA Request, Reply or reject in an MPA revision 2
/// exchange: Linux's 256 bytes less the 4 bytes of the IRD/ORD words (siw_accept's limit).
/// An exchange in revision 1 has no such words and carries 256 (siw's MPA_MAX_PRIVDATA):
/// a device configured for revision 1 connects with up to 256, and accept and reject take
/// up to 256 on a revision-1 Request. rdma_cm puts no header in front of it on iWARP
/// (`cma_connect_iw` passes the user's bytes straight to MPA).
pub const IWARP_PRIVATE_DATA_MAX: usize = rcm_wire::mpa::ENHANCED_USER_MAX;

/// What `connect` on `dev` may carry: 256 bytes on a device that speaks revision 1 only.
fn iw_pd(dev: &DeviceInner, len: usize) -> Result<()> {
    let max = if dev.iw.as_ref().is_some_and(|i| i.cfg.max_revision < 2) {
        rcm_wire::mpa::MAX_PRIVATE_DATA
    } else {
        IWARP_PRIVATE_DATA_MAX
    };
    if len > max {
        return Err(Error::PrivateDataTooLong { len, max });
    }
    Ok(())
}

fn iw_err(e: iw::CepError, state: State) -> Error {
    match e {
        iw::CepError::PrivateDataTooLong { len, max } => Error::PrivateDataTooLong { len, max },
        iw::CepError::InvalidState(_) => Error::InvalidState(state),
        e => Error::InvalidArgument(e.to_string().into()),
    }
}

/// Ends a stream an id owned: its events stop being routed, and the Cep is destroyed (an
/// unanswered Request is rejected, an established connection reset: `destroy_cm_id`).
fn iw_destroy(dev: &Arc<DeviceInner>, key: ConnKey) {
    if let Some(iw) = &dev.iw {
        forget(&iw.owners, &key);
    }
    dev.iw_cep(key, iw::Cep::destroy);
}

/// An iWARP connection's device and key, from the id's state; `None` on RoCE; an iWARP id
/// with no connection is in the wrong state for what asked.
fn iw_conn_of(g: &IdState) -> Result<Option<(Arc<DeviceInner>, ConnKey)>> {
    Ok(match (&g.device, g.iw.map(std::num::NonZeroUsize::get)) {
        (Some(d), Some(k)) if d.is_iwarp() => Some((d.clone(), k)),
        (Some(d), None) if d.is_iwarp() => return Err(Error::InvalidState(g.state)),
        _ => None,
    })
}

impl CmId {
    /// The iWARP device and stream of this id, if it has one.
    fn iw_conn(&self) -> Result<Option<(Arc<DeviceInner>, ConnKey)>> {
        iw_conn_of(&*self.usable()?)
    }

    /// `rdma_connect` on iWARP (`cma_connect_iw` → `iw_cm_connect`): TCP to the peer's
    /// port, then an MPA revision-2 Request with the user's private data as is.
    fn iw_connect(&self, dev: &Arc<DeviceInner>, opts: &ConnectOptions) -> Result<()> {
        let (dst, port, qpn) = {
            let mut g = self.usable()?;
            if g.state != State::RouteResolved {
                return Err(Error::InvalidState(g.state));
            }
            if is_ud(self.0.ps) {
                return Err(Error::InvalidArgument(
                    "iWARP carries only the TCP port space (no UD)".into(),
                ));
            }
            iw_pd(dev, opts.private_data.len())?;
            // Beyond the device the connect fails (siw_connect: -ENOMEM; librdmacm's
            // ucma_valid_param: EINVAL), as `accept` does; it was lowered silently.
            let (max_ird, max_ord) = dev
                .iw
                .as_ref()
                .map_or((128, 128), |i| (i.cfg.max_ird, i.cfg.max_ord));
            if u16::from(opts.responder_resources) > max_ird
                || u16::from(opts.initiator_depth) > max_ord
            {
                return Err(Error::InvalidArgument(
                    format!(
                        "responder_resources {} / initiator_depth {}: the device takes at most \
                         {max_ird} / {max_ord}",
                        opts.responder_resources, opts.initiator_depth
                    )
                    .into(),
                ));
            }
            let dst = g.dst.ok_or(Error::InvalidState(g.state))?;
            let qpn = Self::claim_qp(&mut g, opts.qpn, &self.0.fabric)?;
            // Under the check's lock, as in `connect`: a destroy in between is not overwritten.
            g.state = State::Connect;
            (dst, g.src.map_or(0, |s| s.port()), qpn)
        };
        // A device configured for revision 1 (an RFC 5044-only peer, or siw's mpa_version=1)
        // also initiates with it.
        let version = if dev.iw.as_ref().is_some_and(|i| i.cfg.max_revision < 2) {
            iw::MpaVersion::V1
        } else {
            iw::MpaVersion::V2
        };
        let p = iw::ConnectParams {
            version,
            ird: u16::from(opts.responder_resources),
            ord: u16::from(opts.initiator_depth),
            private_data: opts.private_data.clone(),
            ..iw::ConnectParams::default()
        };
        let r = dev.iw_connect(dst, port, p, Arc::downgrade(&self.0));
        let mut g = sync::lock(&self.0.st);
        match r {
            Ok(k) if g.state == State::Destroying || g.removed => {
                // Destroyed or its device removed meanwhile: the teardown (or the removal's
                // walk) did not see this stream; end it here.
                let e = gone(&g);
                drop(g);
                iw_destroy(dev, k);
                Err(e)
            }
            Ok(k) => {
                g.iw = std::num::NonZeroUsize::new(k);
                g.conn.local_qpn = qpn;
                Ok(())
            }
            Err(e) => {
                if g.state == State::Connect {
                    g.state = State::RouteResolved;
                }
                Self::unclaim_qp(&mut g);
                Err(e)
            }
        }
    }

    fn iw_accept(&self, dev: &Arc<DeviceInner>, key: ConnKey, opts: &AcceptOptions) -> Result<()> {
        {
            let mut g = self.usable()?;
            if g.state != State::Connect || g.listener.is_none() || g.conn.accepted {
                return Err(Error::InvalidState(g.state));
            }
            // The private data's limit depends on the Request's revision: the Cep judges it.
            Self::claim_qp(&mut g, opts.qpn, &self.0.fabric)?;
        }
        let p = iw::AcceptParams {
            ird: u16::from(opts.responder_resources),
            ord: u16::from(opts.initiator_depth),
            crc: false,
            private_data: opts.private_data.clone(),
        };
        // `accept` queues the Reply and (no peer-to-peer mode) the Cep's ESTABLISHED, which
        // is routed to this id behind any event already queued for it.
        let r = dev.iw_cep(key, |c, now| c.accept(now, &p));
        let mut g = sync::lock(&self.0.st);
        match r {
            Some(Ok(())) => {
                g.conn.accepted = true;
                drop(g);
                leave_backlog(&self.0);
                Ok(())
            }
            Some(Err(e)) => {
                Self::unclaim_qp(&mut g);
                Err(iw_err(e, g.state))
            }
            // The stream is already gone (the peer closed it): `Disconnected` is queued.
            None => {
                Self::unclaim_qp(&mut g);
                Err(Error::InvalidState(State::Disconnect))
            }
        }
    }

    fn iw_reject(&self, dev: &Arc<DeviceInner>, key: ConnKey, pd: &[u8]) -> Result<()> {
        {
            let g = self.usable()?;
            if g.state != State::Connect || g.listener.is_none() || g.conn.accepted {
                return Err(Error::InvalidState(g.state));
            }
            // The private data's limit depends on the Request's revision: the Cep judges it.
        }
        // An MPA Reply with R set and the private data, then FIN (`siw_reject`); the iw_cm
        // generates no event for it.
        let r = dev.iw_cep(key, |c, now| c.reject(now, pd));
        let mut g = sync::lock(&self.0.st);
        match r {
            Some(Ok(())) => {
                if g.state == State::Connect {
                    g.state = State::Disconnect;
                }
                drop(g);
                leave_backlog(&self.0);
                Ok(())
            }
            Some(Err(e)) => Err(iw_err(e, g.state)),
            None => Err(Error::InvalidState(State::Disconnect)),
        }
    }

    fn iw_disconnect(&self, dev: &Arc<DeviceInner>, key: ConnKey) -> Result<()> {
        {
            let mut g = self.usable()?;
            // As on RoCE (iw_cm_disconnect in CLOSING is a no-op returning 0).
            if g.state == State::Disconnect {
                return Ok(());
            }
            if g.state == State::Connect {
                // A request not answered yet (iw_cm CONN_RECV): nothing to do, and the
                // request stays to be accepted or rejected. A connection being set up (our
                // Request out, or accepted and not up yet): iw_cm_disconnect waits for it
                // and then closes; rcm closes it once it is up, without making the caller
                // wait. Either way the call succeeds, as on Linux.
                if g.listener.is_none() || g.conn.accepted {
                    g.iw_close_when_up = true;
                }
                return Ok(());
            }
            if g.state != State::Established {
                return Err(Error::InvalidState(g.state));
            }
        }
        match iw_close(dev, key, &self.0) {
            Some(Err(e)) => Err(iw_err(e, State::Disconnect)),
            // Closing, or the stream is gone already (the peer closed it): going down.
            Some(Ok(())) | None => Ok(()),
        }
    }

    /// Sends one message over an established iWARP connection: an RDMAP Send, framed in
    /// MPA FPDUs on the TCP stream (split into DDP segments when long). The peer gets it from
    /// [`CmId::recv_message`]. On RoCE (rcm does not carry RoCE's data path), on a daemon's
    /// id, and on a connection that is not established this fails, sending nothing; so it
    /// does with `LimitExceeded(SendBuffer)` while [`crate::IW_SEND_BUFFER`] bytes wait for
    /// a peer that is not reading (try again once it has).
    pub fn send(&self, msg: &[u8]) -> Result<()> {
        if self.0.remote().is_some() {
            return Err(Error::InvalidArgument(
                "messages are not carried through a provider".into(),
            ));
        }
        let (dev, key) = {
            let g = self.usable()?;
            match (&g.device, g.iw.map(std::num::NonZeroUsize::get)) {
                (Some(d), Some(k)) if d.is_iwarp() => {
                    if g.state != State::Established {
                        return Err(Error::InvalidState(g.state));
                    }
                    (d.clone(), k)
                }
                (Some(d), None) if d.is_iwarp() => return Err(Error::InvalidState(g.state)),
                _ => {
                    return Err(Error::InvalidArgument(
                        "send needs an iWARP connection (rcm has no RoCE data path)".into(),
                    ))
                }
            }
        };
        match dev.iw_send(key, msg) {
            Some(Ok(Ok(()))) => Ok(()),
            Some(Ok(Err(e))) => Err(iw_err(e, self.state())),
            Some(Err(crate::iwarp::SendBufferFull)) => {
                Err(Error::LimitExceeded(crate::remote::Limit::SendBuffer))
            }
            None => Err(Error::InvalidState(State::Disconnect)),
        }
    }

    /// The next message the peer sent ([`CmId::send`]), waiting up to `timeout`. Messages are
    /// kept in arrival order until taken (not events: they need no ack and do not hold the
    /// id); those not taken are dropped when the id is destroyed. What waits untaken is
    /// bounded like posted receive buffers: past `CepConfig::recv_queue` messages or
    /// `CepConfig::recv_bytes` bytes the peer's next Send ends the stream (a Terminate, as
    /// siw without a posted receive). Returns `None` once the id is being destroyed.
    pub fn recv_message(&self, timeout: std::time::Duration) -> Option<Vec<u8>> {
        crate::fabric::before_wait();
        let end = rcm_proto::later(std::time::Instant::now(), timeout);
        let mail = self.0.mail();
        let mut q = mail.inbox.lock();
        loop {
            if let Some(m) = q.pop_front() {
                drop(q);
                self.iw_message_taken();
                return Some(m);
            }
            let left = end.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() || !self.0.slot.is_live() {
                return None;
            }
            // The teardown wakes this wait, but a destroy's teardown may wait for this very
            // thread (a callback calling recv_message): liveness is looked at every 50 ms.
            q = mail.inbox.wait_timeout(q, left.min(RECV_LIVENESS_POLL));
        }
    }

    /// The next message already received, if any.
    pub fn try_recv_message(&self) -> Option<Vec<u8>> {
        let m = self.0.mail_if_any()?.inbox.lock().pop_front()?;
        self.iw_message_taken();
        Some(m)
    }

    /// A received message was taken: its receive buffer is free for the next Send
    /// ([`rcm_proto::iw::CepConfig::recv_queue`]).
    fn iw_message_taken(&self) {
        let (dev, key) = {
            let g = sync::lock(&self.0.st);
            match (&g.device, g.iw) {
                (Some(d), Some(k)) => (d.clone(), k.get()),
                _ => return,
            }
        };
        dev.iw_cep(key, |c, _| c.messages_taken(1));
    }
}

/// An event of an iWARP stream: a new connect request, or what it does to the id owning the
/// stream (`cma_iw_handler`'s mapping).
pub(crate) fn on_iw_event(dev: &Arc<DeviceInner>, key: ConnKey, ev: IwEvent) {
    let Some(iwd) = dev.iw.as_ref() else { return };
    let ev = match ev {
        IwEvent::Request { port, peer, req } => {
            return on_iw_connect_request(dev, key, port, peer, req);
        }
        ev => ev,
    };
    let id = sync::lock(&iwd.owners).get(&key).and_then(Weak::upgrade);
    let Some(id) = id else { return };
    let mut close_when_up = false;
    let out = {
        let mut g = sync::lock(&id.st);
        if g.removed {
            // After DeviceRemoval only destroy is valid: no event, no state change.
            return;
        }
        match ev {
            // Routed above; a Cep's own request is always turned into one.
            IwEvent::Request { .. } | IwEvent::Cep(iw::Event::ConnectRequest(_)) => None,
            IwEvent::ConnectFailed(kind) => {
                if g.state != State::Connect {
                    return;
                }
                g.state = State::Disconnect;
                CmId::unclaim_qp(&mut g);
                // Nobody listens on that TCP port: the RST is what IB's REJ "invalid service
                // ID" is on RoCE, and rdma_cm reports -ECONNREFUSED as REJECTED.
                Some(if kind == std::io::ErrorKind::ConnectionRefused {
                    Event::Rejected {
                        reason: RejReason::InvalidServiceId,
                        private_data: Vec::new(),
                    }
                } else {
                    Event::Unreachable(Unreachable::Timeout)
                })
            }
            IwEvent::Cep(iw::Event::ConnectReply(reply)) => {
                if g.state != State::Connect {
                    return;
                }
                Some(match reply {
                    iw::ConnectReply::Accepted(neg) => {
                        // `cm_conn_rep_handler`: status 0 is ESTABLISHED at once, carrying the
                        // Reply's private data.
                        g.state = State::Established;
                        close_when_up = std::mem::take(&mut g.iw_close_when_up);
                        g.conn.responder_resources = u8::try_from(neg.ird).unwrap_or(u8::MAX);
                        g.conn.initiator_depth = u8::try_from(neg.ord).unwrap_or(u8::MAX);
                        Event::Established {
                            ud: None,
                            private_data: neg.private_data,
                        }
                    }
                    iw::ConnectReply::Rejected { private_data, .. } => {
                        g.state = State::Disconnect;
                        CmId::unclaim_qp(&mut g);
                        Event::Rejected {
                            reason: RejReason::ConsumerDefined,
                            private_data,
                        }
                    }
                    iw::ConnectReply::Error(e) => {
                        g.state = State::Disconnect;
                        CmId::unclaim_qp(&mut g);
                        // `cma_iw_handler`: -ETIMEDOUT → UNREACHABLE, -ECONNRESET and
                        // -ECONNREFUSED → REJECTED, anything else → CONNECT_ERROR. siw's
                        // `siw_proc_mpareply` refuses a Reply asking for markers with
                        // -ECONNREFUSED and one that drops MPA v2 after our enhanced Request
                        // with -ECONNRESET.
                        match e {
                            iw::ConnectError::Timeout => Event::Unreachable(Unreachable::Timeout),
                            iw::ConnectError::PeerClosed
                            | iw::ConnectError::Reset
                            | iw::ConnectError::Protocol(
                                iw::ProtocolError::MarkersRequested
                                | iw::ProtocolError::RevisionMismatch,
                            ) => Event::Rejected {
                                reason: RejReason::ConsumerDefined,
                                private_data: Vec::new(),
                            },
                            iw::ConnectError::Protocol(p) => {
                                Event::ConnectError(Error::Io(format!("MPA protocol error: {p:?}")))
                            }
                        }
                    }
                })
            }
            IwEvent::Cep(iw::Event::Established(_)) => {
                if g.state != State::Connect {
                    return;
                }
                g.state = State::Established;
                close_when_up = std::mem::take(&mut g.iw_close_when_up);
                Some(Event::Established {
                    ud: None,
                    private_data: Vec::new(),
                })
            }
            IwEvent::Cep(iw::Event::Disconnect) => {
                // `cm_disconnect_handler`: ESTABLISHED → CLOSING, no upcall; the CLOSE that
                // follows is what rdma_cm reports.
                if g.state == State::Established {
                    g.state = State::Disconnect;
                }
                None
            }
            IwEvent::Cep(iw::Event::Close(_)) => {
                // Also for a request that was never answered or accepted: the peer gave up,
                // and rdma_cm reports CLOSE as DISCONNECTED whatever the state.
                if !matches!(
                    g.state,
                    State::Connect | State::Established | State::Disconnect
                ) || g.disconnected_reported
                {
                    return;
                }
                g.state = State::Disconnect;
                g.disconnected_reported = true;
                CmId::unclaim_qp(&mut g);
                Some(Event::Disconnected)
            }
            IwEvent::Cep(iw::Event::Message(m)) => {
                drop(g);
                let mail = id.mail();
                let mut q = mail.inbox.lock();
                // A message for an id whose teardown began (and cleared the queue, or will)
                // is dropped, not kept past the destroy.
                if id.slot.is_live() {
                    q.push_back(m);
                    mail.inbox.wake(q);
                }
                None
            }
        }
    };
    if let Some(ev) = out {
        id.slot.push(ev);
    }
    if close_when_up {
        // The disconnect asked for while connecting, now that ESTABLISHED is queued (not
        // through `disconnect`: the thread routing this event may hold the id's `op`).
        let _ = iw_close(dev, key, &id);
    }
}

/// Closes an established iWARP connection gracefully: FIN after what is queued, the id
/// going to Disconnect; `Disconnected` follows once the peer's FIN is in
/// (`iw_cm_disconnect(abrupt = 0)`). `None` when the stream is gone already.
fn iw_close(
    dev: &Arc<DeviceInner>,
    key: ConnKey,
    id: &IdInner,
) -> Option<std::result::Result<(), iw::CepError>> {
    let r = dev.iw_cep(key, iw::Cep::disconnect)?;
    if r.is_ok() {
        let mut g = sync::lock(&id.st);
        if g.state == State::Established {
            g.state = State::Disconnect;
        }
    }
    Some(r)
}

/// A valid MPA Request arrived on a stream accepted on TCP `port`: find the rdma_cm listener
/// (`iw_conn_req_handler`), build the child completely, join it to the listener while that
/// still listens, publish it, then deliver `ConnectRequest` on it. Without a listener the
/// Request is rejected (MPA Reply with R).
fn on_iw_connect_request(
    dev: &Arc<DeviceInner>,
    key: ConnKey,
    port: u16,
    peer: SocketAddr,
    req: iw::ConnectRequest,
) {
    let Some(iwd) = dev.iw.as_ref() else { return };
    let refuse = |dev: &Arc<DeviceInner>| {
        dev.iw_cep(key, |c, now| {
            let _ = c.reject(now, &[]);
        });
    };
    let candidates: Vec<Arc<IdInner>> = sync::lock(&iwd.listens)
        .get(&port)
        .map(|(_, ids)| ids.iter().filter_map(Weak::upgrade).collect())
        .unwrap_or_default();
    let Some(lst) = candidates.into_iter().find(|l| l.slot.is_live()) else {
        return refuse(dev);
    };
    let Some(target) = lst.slot_target() else {
        return refuse(dev);
    };
    let child = build(&lst.fabric, lst.ps, target);
    // From our side (see `ConnParam`): the peer's ORD is what we must respond to. Capped by
    // what this device takes, as siw caps them before its upcall, so that `accept` with
    // these values succeeds.
    let cap =
        |v: Option<u16>, max: u16| v.map_or(0, |v| u8::try_from(v.min(max)).unwrap_or(u8::MAX));
    let param = ConnParam {
        responder_resources: cap(req.ord, iwd.cfg.max_ird),
        initiator_depth: cap(req.ird, iwd.cfg.max_ord),
        ..ConnParam::default()
    };
    {
        let mut g = sync::lock(&child.0.st);
        g.state = State::Connect;
        g.src = Some(SocketAddr::new(dev.ip, port));
        g.dst = Some(peer);
        g.device = Some(dev.clone());
        g.iw = std::num::NonZeroUsize::new(key);
        g.listener = Some(Arc::downgrade(&lst));
        g.request_unseen = true;
        g.in_backlog = true;
        g.conn.responder_resources = param.responder_resources;
        g.conn.initiator_depth = param.initiator_depth;
    }
    {
        let mut g = sync::lock(&lst.st);
        // The backlog bounds the requests not delivered to the application yet, as ucma's
        // does (0: 1,024, ucma's max_backlog); one more is refused (an MPA Reject, as for a
        // listener that is gone): a listener whose callbacks are slow cannot be made to
        // hold any number of children and streams.
        let full = backlog_full(g.listening.as_deref(), crate::iwarp::IW_DEFAULT_BACKLOG);
        if g.state != State::Listen
            || !lst.slot.is_live()
            || dev.removed.load(std::sync::atomic::Ordering::SeqCst)
            || full
        {
            drop(g);
            {
                let mut c = sync::lock(&child.0.st);
                c.request_unseen = false;
                c.in_backlog = false;
            }
            // The child's teardown rejects the Request (the Cep is still unanswered).
            drop(child.begin_destroy());
            return;
        }
        let l = g.listening.get_or_insert_with(Box::default);
        l.undelivered += 1;
        l.children.insert(child.0.key, Arc::downgrade(&child.0));
        join_listeners_channel(&lst, &child);
    }
    // Refused once the fabric shuts down: the child is then destroyed, and is gone below.
    let _ = publish(&child);
    sync::lock(&iwd.owners).insert(key, Arc::downgrade(&child.0));
    if gone_before_published(&child) {
        forget(&iwd.owners, &key);
        return;
    }
    // Before the request is queued (see `on_connect_request`).
    removal_after_publish(&child, dev);
    child.0.slot.push(Event::ConnectRequest {
        listener: CmId(lst),
        private_data: req.private_data,
        param,
        ud: false,
    });
}

// ---------------------------------------------------------------------------------------
// UD: a minimal datagram path on the RoCEv2 device's socket (SIDR resolves where to send;
// these calls send and receive UD SEND Only packets with BTH, DETH and ICRC).

impl CmId {
    /// The QP number this id announced: the one its `connect` or `accept` used (an attached
    /// QP's, `qpn` of the options, or a fresh soft QPN). A UD id receives datagrams on it and
    /// sends with it as the DETH source QP. `None` before `connect`/`accept` (and on a
    /// provider's id).
    pub fn qp_num(&self) -> Option<u32> {
        if self.0.remote().is_some() {
            return None;
        }
        let q = sync::lock(&self.0.st).conn.local_qpn;
        (q != 0).then_some(q)
    }

    /// Sends one UD datagram (`ibv_post_send` of a UD SEND on the id's QP, in rcm's own
    /// minimal data path): a RoCEv2 UD SEND Only (BTH opcode 0x64, P_Key 0xFFFF, `ud.qpn` as
    /// destination QP, a PSN counting up per id), a DETH with `ud.qkey` and this id's QPN
    /// ([`CmId::qp_num`]) as source QP, the payload, pad and a correct ICRC, from the id's
    /// device socket to `dst`'s RoCEv2 port. The ICRC assumes the IPv4 header Linux writes for
    /// that socket (ID 0, DF: the socket is unconnected with `IP_PMTUDISC_DO`), which rxe
    /// verifies and accepts.
    ///
    /// The id must be a UD id ([`PortSpace::Udp`] or `Ipoib`) on a RoCEv2 device, in
    /// [`State::Established`]: the client after its `Established { ud: Some(..) }` (whose
    /// [`UdParam`] is what to pass here), the server after `accept`. `payload` is at most
    /// [`UD_MAX_PAYLOAD`] bytes (and should fit the path MTU); `ud.qpn` must be a 24-bit QPN
    /// other than QP0/QP1. UD is unreliable: success means the datagram left the socket.
    /// Not available on a provider's (daemon's) id.
    pub fn send_ud(&self, dst: IpAddr, ud: UdParam, payload: &[u8]) -> Result<()> {
        self.ud_send(dst, ud, None, payload)
    }

    /// Like [`CmId::send_ud`], as a UD SEND Only with Immediate (opcode 0x65): `imm` goes in
    /// the ImmDt header (big-endian on the wire, as `htobe32` gives it to `ibv_post_send`).
    /// rdma-core's `udaddy` sends its own QPN this way, and its server answers to the QPN in
    /// the immediate data: pass [`CmId::qp_num`] to be answered by it.
    pub fn send_ud_with_imm(
        &self,
        dst: IpAddr,
        ud: UdParam,
        imm: u32,
        payload: &[u8],
    ) -> Result<()> {
        self.ud_send(dst, ud, Some(imm), payload)
    }

    fn ud_send(&self, dst: IpAddr, ud: UdParam, imm: Option<u32>, payload: &[u8]) -> Result<()> {
        if self.0.remote().is_some() {
            return Err(Error::InvalidArgument(
                "UD datagrams are not carried through a provider".into(),
            ));
        }
        if !is_ud(self.0.ps) {
            return Err(Error::InvalidArgument(
                "UD datagrams need a UD (PortSpace::Udp) id".into(),
            ));
        }
        if payload.len() > UD_MAX_PAYLOAD {
            return Err(Error::InvalidArgument(
                format!(
                    "UD payload of {} bytes; at most {UD_MAX_PAYLOAD}",
                    payload.len()
                )
                .into(),
            ));
        }
        if ud.qpn <= rcm_wire::roce::GSI_QPN || ud.qpn > 0xFF_FFFF {
            return Err(Error::InvalidArgument(
                format!("destination QPN {:#x}: not a 24-bit UD QPN", ud.qpn).into(),
            ));
        }
        let (dev, src_qp) = {
            let g = self.usable()?;
            if g.state != State::Established {
                return Err(Error::InvalidState(g.state));
            }
            let Some(dev) = g.device.clone().filter(|d| !d.is_iwarp()) else {
                return Err(Error::InvalidState(g.state));
            };
            if g.conn.local_qpn == 0 {
                return Err(Error::InvalidState(g.state));
            }
            (dev, g.conn.local_qpn)
        };
        let psn = self
            .0
            .extra
            .get_or_init(Box::default)
            .ud_psn
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            & 0xFF_FFFF;
        let bth = rcm_wire::roce::Bth {
            opcode: if imm.is_some() {
                rcm_wire::roce::Opcode::UD_SEND_ONLY_IMM
            } else {
                rcm_wire::roce::Opcode::UD_SEND_ONLY
            },
            dest_qp: ud.qpn,
            // A UD QP's SENDs carry no AckReq (rxe sets it only on QP1's MADs).
            ack_req: false,
            ..rcm_wire::roce::Bth::gsi(psn)
        };
        let deth = rcm_wire::roce::Deth {
            qkey: ud.qkey,
            reserved: 0,
            src_qp,
        };
        dev.send_ud(dst, &bth, &deth, imm, payload)
    }

    /// The next UD datagram received for this id, waiting up to `timeout`.
    ///
    /// A UD id receives from its `connect` or `accept` until it is destroyed (or its device
    /// removed, or the SIDR failed): the device queues to it every UD SEND Only (with or
    /// without immediate data) whose destination QPN is [`CmId::qp_num`] and whose DETH
    /// Q_Key is rdma_cm's `RDMA_UDP_QKEY` (0x01234567); others are dropped and counted
    /// ([`crate::Device::ud_stats`]). At most [`UD_RECV_QUEUE`] wait to be taken; more are
    /// dropped. The ICRC of a received datagram is not verified (a UDP socket cannot see the
    /// IPv4 ID it covers). Datagrams are not events: they need no ack and do not hold the
    /// id; after destroy this returns `None`.
    pub fn recv_ud(&self, timeout: std::time::Duration) -> Option<UdMessage> {
        if self.0.remote().is_some() {
            return None;
        }
        crate::fabric::before_wait();
        let end = rcm_proto::later(std::time::Instant::now(), timeout);
        let mail = self.0.mail();
        let mut q = mail.ud_inbox.lock();
        loop {
            if !self.0.slot.is_live() {
                return None;
            }
            if let Some(m) = q.pop_front() {
                return Some(m);
            }
            let left = end.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return None;
            }
            q = mail.ud_inbox.wait_timeout(q, left);
        }
    }

    /// The next UD datagram already received, if any (see [`CmId::recv_ud`]).
    pub fn try_recv_ud(&self) -> Option<UdMessage> {
        if !self.0.slot.is_live() {
            return None;
        }
        self.0.mail_if_any()?.ud_inbox.lock().pop_front()
    }
}

/// Makes `id` the receiver of UD datagrams to `qpn` on `dev`. A QPN another live UD id of
/// the device receives on is refused (two UD QPs cannot share a number).
fn register_ud(dev: &Arc<DeviceInner>, qpn: u32, id: &Arc<IdInner>) -> Result<()> {
    // Before the QPN can be known to a peer: a quiet device's receive cannot tell a run of
    // datagrams the kernel coalesced from one datagram (see `sys::gsi_run_stride`), which
    // for UD SENDs, unlike GSI datagrams, no size gives away.
    dev.receive_one_by_one()?;
    {
        let mut m = sync::lock(&dev.ud_qps);
        if let Some(other) = m.get(&qpn).and_then(Weak::upgrade) {
            if !Arc::ptr_eq(&other, id) && other.slot.is_live() {
                return Err(Error::QpBusy(
                    format!("QPN {qpn:#x} already receives UD datagrams on this device").into(),
                ));
            }
        }
        m.insert(qpn, Arc::downgrade(id));
    }
    // Destroyed meanwhile: its teardown may have looked before the entry existed.
    if !id.slot.is_live() {
        unregister_ud(dev, qpn, id);
        return Err(Error::Destroyed);
    }
    Ok(())
}

/// Removes `id`'s registration for `qpn` (another id's stays).
fn unregister_ud(dev: &Arc<DeviceInner>, qpn: u32, id: &IdInner) {
    let mut m = sync::lock(&dev.ud_qps);
    let mine = m
        .get(&qpn)
        .is_some_and(|w| w.strong_count() == 0 || std::ptr::eq(w.as_ptr(), id));
    if mine {
        m.remove(&qpn);
        rcm_proto::room::shrink_map(&mut m);
    }
}

/// Queues a UD datagram to the id registered for its destination QPN, or counts in `stats`
/// why not. A queued datagram is counted before it becomes visible to `recv_ud`.
pub(crate) fn deliver_ud(
    id: &Arc<IdInner>,
    src: IpAddr,
    d: crate::device::UdDatagram,
    stats: &crate::device::DeviceStats,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let receiving = id.fabric.cfg.ud_receive && {
        let g = sync::lock(&id.st);
        !g.removed && matches!(g.state, State::Connect | State::Established)
    };
    if !receiving {
        stats.ud_no_qp.fetch_add(1, Relaxed);
        return;
    }
    if d.qkey != cma::RDMA_UDP_QKEY {
        stats.ud_bad_qkey.fetch_add(1, Relaxed);
        return;
    }
    let mail = id.mail();
    let mut q = mail.ud_inbox.lock();
    // Checked under the queue's lock: the teardown clears the queue after the slot stopped
    // being live, so nothing queued here can outlive the id.
    if !id.slot.is_live() {
        stats.ud_no_qp.fetch_add(1, Relaxed);
        return;
    }
    if q.len() >= UD_RECV_QUEUE {
        stats.ud_queue_full.fetch_add(1, Relaxed);
        return;
    }
    stats.ud_delivered.fetch_add(1, Relaxed);
    q.push_back(UdMessage {
        src,
        src_qpn: d.src_qp,
        imm: d.imm,
        payload: d.payload,
    });
    mail.ud_inbox.wake(q);
}

/// Removes `k` from a per-connection table and gives back the room a flood left in it
/// (`rcm_proto::room`): the fabric lives as long as its process, a daemon's for days.
fn forget<K: Eq + std::hash::Hash, V, S: std::hash::BuildHasher>(
    table: &Mutex<std::collections::HashMap<K, V, S>>,
    k: &K,
) {
    let mut t = sync::lock(table);
    t.remove(k);
    rcm_proto::room::shrink_map(&mut t);
}
