//! Ids served by another process (the `rcm daemon`, through the `rcm-ucm` client library).
//!
//! A [`Fabric`](crate::Fabric) built with [`Fabric::with_provider`](crate::Fabric::with_provider)
//! has no devices of its own: every operation on its ids is an [`Op`] that a [`Provider`]
//! carries out elsewhere, and the provider feeds the events back through a [`Sink`]. Everything
//! the caller can observe locally keeps the in-process guarantees, because it runs on the same
//! per-id machinery: callbacks for one id are serialised, `destroy` returns only when no
//! callback runs or ever will, `Flow::Destroy` and destroy-from-a-callback behave the same, and
//! a held channel event keeps its id. Losing the provider is a device removal: every id gets
//! one `DeviceRemoval`.

use crate::event::{ConnParam, Event};
use crate::id::{AcceptOptions, ConnectOptions, IdInner, QpAttr, QpState, State};
use crate::Result;
use rcm_wire::cma::PortSpace;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Weak};

/// One operation on an id: the rdma_cm calls that can be carried out by whoever owns the
/// device (see [`CmId::call`](crate::CmId::call)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `set_reuseaddr`.
    SetReuseaddr(bool),
    /// `bind`.
    Bind(SocketAddr),
    /// `resolve_addr`.
    ResolveAddr {
        /// Source address, if any.
        src: Option<IpAddr>,
        /// Destination.
        dst: SocketAddr,
    },
    /// `resolve_route`.
    ResolveRoute,
    /// `listen` with a backlog.
    Listen(usize),
    /// `create_qp`.
    CreateQp,
    /// `destroy_qp`.
    DestroyQp,
    /// `connect`.
    Connect(ConnectOptions),
    /// `accept`.
    Accept(AcceptOptions),
    /// `reject` with private data.
    Reject(Vec<u8>),
    /// `establish`.
    Establish,
    /// `notify_established`.
    NotifyEstablished,
    /// `disconnect`.
    Disconnect,
    /// `init_qp_attr`.
    InitQpAttr(QpState),
    /// State and addresses ([`IdInfo`]).
    Query,
}

/// What an [`Op`] returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Done, nothing to return.
    Done,
    /// A QP number (`CreateQp`).
    Qpn(u32),
    /// QP attributes (`InitQpAttr`).
    QpAttr(QpAttr),
    /// The id's state and addresses (`Query`).
    Info(IdInfo),
}

/// An id's state and addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdInfo {
    /// The rdma_cm state.
    pub state: State,
    /// Local address, once bound.
    pub local: Option<SocketAddr>,
    /// Peer address, once known.
    pub peer: Option<SocketAddr>,
    /// Address of the device the id is on.
    pub device: Option<IpAddr>,
}

/// Which per-client limit of a provider was hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Limit {
    /// Ids held by one client.
    Ids,
    /// Events queued for one client.
    QueuedEvents,
    /// Connect requests delivered to no one yet.
    UnreadRequests,
    /// Bytes in one message.
    MessageSize,
    /// Commands waiting to be answered.
    PendingCommands,
    /// Command channels open to one client's session.
    Channels,
    /// Bytes waiting to be sent on one iWARP connection ([`crate::IW_SEND_BUFFER`]).
    SendBuffer,
    /// Connections a daemon serves at once (sessions, their command channels, and those
    /// not through their handshake yet).
    Connections,
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Limit::Ids => "ids per client",
            Limit::QueuedEvents => "queued events per client",
            Limit::UnreadRequests => "unread connect requests per client",
            Limit::MessageSize => "bytes per message",
            Limit::PendingCommands => "pending commands per client",
            Limit::Channels => "command channels per client",
            Limit::SendBuffer => "unsent bytes per iWARP connection",
            Limit::Connections => "connections the daemon serves at once",
        })
    }
}

/// Whoever carries out the operations of a provider-backed fabric.
pub trait Provider: Send + Sync + 'static {
    /// Creates an id at the provider. Its events go to `sink`.
    fn create_id(&self, ps: PortSpace, sink: Sink) -> Result<Arc<dyn RemoteId>>;
    /// The addresses of the provider's devices.
    fn device_addrs(&self) -> Vec<IpAddr>;
    /// The fabric is shutting down: release everything.
    fn shutdown(&self);
    /// What threads waiting for events received themselves (busy polling, see
    /// [`RemoteId::busy_poll`]), in the provider's own unit (the daemon client: frames).
    fn busy_polled(&self) -> u64 {
        0
    }
}

/// An id at a provider.
pub trait RemoteId: Send + Sync + 'static {
    /// Carries out one operation, synchronously.
    fn call(&self, op: Op) -> Result<Reply>;
    /// The id was destroyed locally (exactly once, after its last callback): destroy it at the
    /// provider. Must not wait for anything an event callback could be holding.
    fn release(&self);
    /// What a thread that called this id polls when it then waits in
    /// [`crate::EventChannel::get_event`] (busy polling: the provider's receive side, which
    /// most likely brings the answer). `None` (the default): the waiter polls only its channel.
    fn busy_poll(&self) -> Option<Weak<dyn BusyPoll>> {
        None
    }
}

/// What a thread waiting for a channel's event polls besides the channel (busy polling, as
/// `SO_BUSY_POLL` has an application poll the NIC): the receive side that will most likely
/// bring its answer, so that the answer is received, handled and taken by this one thread
/// instead of being handed over from a receiving thread. rcm's devices implement it
/// (see [`RxGate`]); a provider offers one through [`RemoteId::busy_poll`].
///
/// Only threads of the application poll, never inside a callback or with a
/// [`crate::CallbacksHere`] open: events a poll delivers run their callbacks where the
/// fabric's mode puts events from elsewhere.
pub trait BusyPoll: Send + Sync {
    /// The waiter starts polling for up to `spin` (a receiving thread may stand aside until
    /// then, see [`RxGate::polled_for`]).
    fn begin(&self, spin: std::time::Duration);
    /// Receives and handles what is waiting, if anything, without blocking; true when
    /// something was. What the handling sends stays held if this thread holds a
    /// [`crate::SendBatch`]: the waiter sends it when it goes on waiting.
    fn poll(&self) -> bool;
    /// The waiter stopped polling (its event came, or its spin is over): the deadline it set
    /// is taken back if no other waiter polls (see [`RxGate::poll_ended`]). Called once after
    /// each `begin`. A receiving thread asleep standing aside is not woken here (that costs
    /// the waiter a system call, and the same thread usually polls again next): see `kick`.
    fn end(&self);
    /// The thread that last polled this is about to wait without polling it (it sleeps, or
    /// polls another): a receiving thread still asleep standing aside, with no waiter polling,
    /// must resume now, or what comes meanwhile waits for the end of that poll's deadline.
    fn kick(&self);
    /// What is readable when `poll` would find something (a device's socket), so that a
    /// thread that polls several can ask them all in one `poll(2)` and receive only where
    /// something waits; `None` (the default): only `poll` can tell.
    fn readiness(&self) -> Option<Arc<dyn std::os::fd::AsFd + Send + Sync>> {
        None
    }
}

pub use crate::rxgate::{next_nap, RxGate, RxTurn, STAND_ASIDE_RECHECK};

/// Where a provider delivers the events of one id. Cheap to clone; does nothing once the id
/// is destroyed.
#[derive(Clone)]
pub struct Sink(pub(crate) Weak<IdInner>);

impl std::fmt::Debug for Sink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.upgrade() {
            Some(i) => write!(f, "Sink({})", i.key),
            None => f.write_str("Sink(gone)"),
        }
    }
}

impl Sink {
    /// Delivers an event. `ConnectRequest` must go through [`Sink::connect_request`] (it
    /// is dropped here); `DeviceRemoval` marks the id removed (only destroy is valid after).
    pub fn event(&self, ev: Event) {
        if matches!(ev, Event::ConnectRequest { .. }) {
            return;
        }
        if let Some(inner) = self.0.upgrade() {
            crate::id::remote_event(&inner, ev);
        }
    }

    /// A connect request arrived on this (listening) id: builds the child id around `child`,
    /// publishes it, hands its sink to `file` and then delivers `ConnectRequest` on it.
    /// `file` is where the provider records the sink: it runs before anything can see the
    /// child, so the provider can route the child's events (a pipelined call's refusal, say)
    /// from the first call on. Returns the child's sink, or `None` when the listener is
    /// gone, in which case `child` has been released (the provider rejects the request)
    /// and `file` was not called.
    pub fn connect_request(
        &self,
        child: Arc<dyn RemoteId>,
        private_data: Vec<u8>,
        param: ConnParam,
        ud: bool,
        file: impl FnOnce(&Sink),
    ) -> Option<Sink> {
        let Some(l) = self.0.upgrade() else {
            child.release();
            return None;
        };
        crate::id::remote_connect_request(&l, child, private_data, param, ud, file)
    }

    /// Whether the id still takes events.
    pub fn is_live(&self) -> bool {
        self.0.upgrade().is_some_and(|i| i.slot.is_live())
    }
}

/// Marks the calling thread as one a provider runs for its fabric (a reader of the
/// provider's socket, say). Dropping a fabric's last handle shuts the fabric down; on such a
/// thread that shutdown runs on a thread of its own, since waiting for the fabric's
/// callbacks there could wait for work that only this thread would do.
pub fn mark_provider_thread() {
    crate::fabric::mark_own_thread();
}

/// A provider that sent calls of this thread without waiting for their answers (see
/// [`Pipeline`](crate::Pipeline)).
pub trait Pipelined: Send + Sync {
    /// Waits for the answers still owed to this thread's calls, and delivers the failures
    /// among them as their ids' error events.
    fn complete(&self);
}

std::thread_local! {
    /// The providers owed answers for this thread's pipelined calls.
    static OWED: std::cell::RefCell<Vec<Arc<dyn Pipelined>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Whether this thread's answerless calls may go without waiting (a
/// [`Pipeline`](crate::Pipeline) is open).
pub fn pipelining() -> bool {
    crate::fabric::pipeline_open()
}

/// Whether this thread runs the callbacks of a [`CallbacksHere`](crate::CallbacksHere) batch
/// now: a provider may then leave answers owed until the batch ends, where the thread
/// completes its pipelined calls (see [`Pipeline`](crate::Pipeline)).
pub fn running_callbacks_here() -> bool {
    crate::fabric::running_callbacks_here()
}

/// Notes that `p` owes this thread answers: its [`Pipelined::complete`] runs when the
/// pipeline completes (see [`Pipeline`](crate::Pipeline)).
pub fn owe(p: Arc<dyn Pipelined>) {
    let _ = OWED.try_with(|o| {
        let mut o = o.borrow_mut();
        if !o
            .iter()
            .any(|q| std::ptr::addr_eq(Arc::as_ptr(q), Arc::as_ptr(&p)))
        {
            o.push(p);
        }
    });
}

/// Whether a provider owes this thread answers to pipelined calls.
pub(crate) fn owes_answers() -> bool {
    OWED.try_with(|o| o.try_borrow().is_ok_and(|o| !o.is_empty()))
        .unwrap_or(false)
}

/// Completes this thread's pipelined calls (each provider owed answers waits for them).
pub(crate) fn complete_pipelined() {
    let owed = OWED
        .try_with(|o| {
            o.try_borrow_mut()
                .map(|mut o| std::mem::take(&mut *o))
                .unwrap_or_default()
        })
        .unwrap_or_default();
    for p in owed {
        p.complete();
    }
}
