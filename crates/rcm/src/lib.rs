//! rcm: the connection-manager library applications use.
//!
//! A [`Fabric`] holds RoCEv2 devices (a UDP socket on port 4791 of a local address each,
//! running the `rcm-proto` engine) and iWARP devices (TCP on the rdma_cm port, an
//! `rcm_proto::iw::Cep` per stream, see [`Fabric::add_iwarp_device`]), and the rdma_cm layer
//! over both: [`CmId`]s with address and
//! route resolution, port spaces, listen (wildcard across devices), connect, accept, reject,
//! disconnect and QP attribute hand-off. Events reach the user either through a handler
//! (one call at a time per id, in order, returning [`Flow`]) or an [`EventChannel`].
//!
//! UD ids ([`PortSpace::Udp`]) also have a minimal data path on the RoCEv2 device's socket:
//! after SIDR ([`Event::Established`] with a [`UdParam`] on the client, `accept` on the
//! server) [`CmId::send_ud`] sends RoCEv2 UD SEND Only datagrams (BTH, DETH, correct ICRC)
//! that a kernel rxe QP receives, and [`CmId::recv_ud`] takes the ones sent to the id's QPN
//! with rdma_cm's Q_Key ([`UdMessage`]; the ICRC of received datagrams is not verified).
//!
//! Threads: each RoCEv2 device has one I/O thread (receive, engine, timers), callbacks run
//! on a small pool ([`FabricConfig::dispatcher_threads`]), channel events are taken by the
//! application's own threads. A connect crosses about four of them, and waking a sleeping
//! thread costs tens of microseconds on an idle CPU, so an idle thread polls for work for
//! [`FabricConfig::spin`] (100 µs by default; one callback thread at a time; the poll yields
//! the CPU to runnable threads) before it sleeps. `spin: Duration::ZERO` trades that latency
//! for never polling.
//!
//! The lifecycle guarantees (see [`CmId::destroy`], [`CmId::begin_destroy`],
//! [`Fabric::remove_device`]):
//! 1. Callbacks for one id never run concurrently and arrive in order.
//! 2. `destroy` returns `Done` only when no callback for the id is running and none will ever
//!    start; queued events are discarded; the context is dropped exactly once, after the last
//!    callback (a [`CmId::with_context`] closure running elsewhere keeps it until it returns,
//!    and only a destroy that may wait for that does).
//! 3. A callback returning [`Flow::Destroy`] destroys its id after it returns; no further
//!    callback, device removal included, is made for it.
//! 4. `destroy` from inside a callback never deadlocks: it returns `Deferred`, no new
//!    callback starts, and the teardown completes when the running callback returns. The
//!    same holds for a destroy from the drop of a context or handler (in a teardown).
//! 5. `begin_destroy` returns at once with a [`DestroyHandle`] (blocking `wait` or `.await`).
//! 6. Device removal gives each id on the device one `DeviceRemoval` event after the callback
//!    in flight, never after `Flow::Destroy`; then only destroy is valid.
//! 7. A channel event holds its id; a blocking destroy of an id whose events are held fails
//!    with [`Error::EventsOutstanding`] instead of hanging.
//! 8. A fabric lives as long as a [`Fabric`] handle does: dropping the last one shuts it down
//!    as [`Fabric::shutdown`] does (every id destroyed, peers sent DREQ or REJ, devices
//!    stopped, ports released), whatever [`CmId`] handles are still held.
//!
//! Where the events differ from librdmacm's (each deliberate; the wire is Linux's):
//! - The active side's [`CmId::establish`] after `ConnectResponse` is followed by
//!   `Established`, which librdmacm never delivers there (its `rdma_establish` returning is
//!   the end of the connect): one event loop serves both the QP-less and the attached path.
//! - A passive child whose peer withdrew its REQ (REJ, reason Timeout) before the child was
//!   accepted gets `Rejected`; ucma drops that event (the child's `rdma_accept` fails later).
//!   Either way the child holds its place in its listener's backlog only until its request
//!   is delivered.
//! - A DREQ is answered with its DREP at once, with `Disconnected`; Linux answers it when
//!   the application calls `rdma_disconnect` or destroys the id. A later `disconnect`
//!   succeeds and sends nothing, as there.
//! - `Disconnected` carries no status (Linux's is -ETIMEDOUT after a DREQ that got no DREP),
//!   and a RoCE `Established` on a REP no connection parameters (they come with
//!   `ConnectResponse`, and through [`CmId::init_qp_attr`]).
//! - Address resolution looks for a device of the destination's family, not for the
//!   destination's neighbour: an address nobody answers on resolves, and the connect to it
//!   ends `Unreachable` when its REQs run out, where Linux's `rdma_resolve_addr` reports
//!   ADDR_ERROR after its timeout.
//! - [`CmId::disconnect`] refuses a RoCE connection still being set up (see there).

// Under `--cfg loom` only the concurrency core (`slot`, `sync`) is built, for the models in
// `tests/loom.rs`: the rest does I/O on std threads and sockets that loom cannot run.
#[cfg(not(loom))]
mod device;
#[cfg(not(loom))]
mod error;
#[cfg(not(loom))]
mod event;
#[cfg(not(loom))]
mod fabric;
#[cfg(not(loom))]
mod id;
#[cfg(not(loom))]
mod iwarp;
#[cfg(not(loom))]
mod ports;
#[cfg(not(loom))]
mod qp_attr;
#[cfg(not(loom))]
mod qpns;
#[cfg(not(loom))]
pub mod remote;
#[cfg(not(loom))]
mod rxgate;
#[cfg(not(loom))]
mod spin;
// Under loom the core's users are not built, so some of its crate-private API is unused.
#[cfg_attr(loom, allow(dead_code))]
mod slot;
mod sync;
#[cfg(not(loom))]
mod sys;
pub mod trace;
#[cfg(not(loom))]
mod waitq;

#[cfg(not(loom))]
pub use error::{Error, Result};
#[cfg(not(loom))]
pub use event::{ConnParam, Event, UdMessage, UdParam, Unreachable};
#[cfg(not(loom))]
pub use fabric::{
    CallbackMode, CallbacksHere, Device, Fabric, FabricConfig, Pipeline, Removal, SendBatch,
    UdStats, DEFAULT_SPIN,
};
#[cfg(not(loom))]
pub use id::{
    any_addr, AcceptOptions, ChannelEvent, CmId, ConnectOptions, DestroyHandle, EventChannel,
    Handler, QpAttr, QpState, State, IWARP_PRIVATE_DATA_MAX, UD_MAX_PAYLOAD, UD_RECV_QUEUE,
};
#[cfg(not(loom))]
pub use iwarp::IW_SEND_BUFFER;
#[cfg(not(loom))]
pub use ports::EPHEMERAL;
#[cfg(not(loom))]
pub use qp_attr::{AccessFlags, QpAttrMask};
pub use rcm_wire::cma::PortSpace;
/// Test support for the loom models (`--cfg loom` only; not part of the API).
#[cfg(loom)]
pub use slot::loom_api;
pub use slot::{DestroyOutcome, Flow};
#[cfg(not(loom))]
pub use spin::{
    hold_offs, look_here, process_hold_offs, spin_allowed, spin_budget, spin_until,
    yield_to_pollers,
};
