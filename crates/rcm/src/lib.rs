//! rcm: the connection-manager library applications use.
//!
//! A [`Fabric`] holds RoCEv2 devices (a UDP socket on port 4791 of a local address each,
//! running the `rcm-proto` engine) and the rdma_cm layer over them: [`CmId`]s with address and
//! route resolution, port spaces, listen (wildcard across devices), connect, accept, reject,
//! disconnect and QP attribute hand-off. Events reach the user either through a handler
//! (one call at a time per id, in order, returning [`Flow`]) or an [`EventChannel`].
//!
//! The lifecycle guarantees (see [`CmId::destroy`], [`CmId::begin_destroy`],
//! [`Fabric::remove_device`]):
//! 1. Callbacks for one id never run concurrently and arrive in order.
//! 2. `destroy` returns `Done` only when no callback for the id is running and none will ever
//!    start; queued events are discarded; the context is dropped exactly once, after the last
//!    callback.
//! 3. A callback returning [`Flow::Destroy`] destroys its id after it returns; no further
//!    callback, device removal included, is made for it.
//! 4. `destroy` from inside a callback never deadlocks: it returns `Deferred`, no new
//!    callback starts, and the teardown completes when the running callback returns.
//! 5. `begin_destroy` returns at once with a [`DestroyHandle`] (blocking `wait` or `.await`).
//! 6. Device removal gives each id on the device one `DeviceRemoval` event after the callback
//!    in flight, never after `Flow::Destroy`; then only destroy is valid.
//! 7. A channel event holds its id; a blocking destroy of an id whose events are held fails
//!    with [`Error::EventsOutstanding`] instead of hanging.

mod device;
mod error;
mod event;
mod fabric;
mod id;
mod ports;
mod slot;
mod sync;
mod sys;

pub use error::{Error, Result};
pub use event::{ConnParam, Event, UdParam, Unreachable};
pub use fabric::{Device, Fabric, FabricConfig, Removal};
pub use id::{
    any_addr, AcceptOptions, ChannelEvent, CmId, ConnectOptions, DestroyHandle, EventChannel,
    Handler, QpAttr, QpState, State,
};
pub use ports::EPHEMERAL;
pub use rcm_wire::cma::PortSpace;
pub use slot::{DestroyOutcome, Flow};
