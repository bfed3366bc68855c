//! rcm-ucm: user-space access to a host's CM ports.
//!
//! Only one process can own UDP port 4791 on an address, as only the kernel owns QP1. The
//! [`daemon`] owns the devices of a host's addresses and serves many processes over a Unix
//! socket with a small versioned binary protocol ([`proto`], documented in
//! `docs/ucm-protocol.md`) modelled on the kernel's ucma commands. The [`client`] library
//! gives those processes the ordinary [`rcm`] API over that socket: [`fabric`] returns an
//! [`rcm::Fabric`] whose ids live in the daemon, so switching between in-process devices and
//! the daemon is configuration, not code.
//!
//! What the daemon guarantees each client (session):
//! - it sees only its own ids: a handle of another session is the same error as one that
//!   never existed;
//! - when it closes its socket or dies, every id it held is destroyed (peers see a REJ or a
//!   DREQ), its listeners stop, nothing leaks;
//! - an event it cannot take (queue full, client gone) is dropped and counted, never turned
//!   into a second destroy; a connect request it cannot take is rejected on the wire;
//! - a connect request's child id is fully built and owned by the listener's session before
//!   the event is visible;
//! - limits per session: ids and message size are typed errors (`LimitExceeded`); an
//!   event beyond the queued-events limit is dropped and counted, a connect request beyond
//!   the unread-requests limit refused on the wire and counted (`Stats`); one client
//!   hitting them does not slow the others.
#![forbid(unsafe_code)]

pub mod client;
pub mod daemon;
pub mod proto;
pub mod raw;
pub mod shmchan;
mod spin;

pub use client::{daemon_from_env, fabric, fabric_with, Client};
pub use daemon::{Daemon, DaemonConfig, DaemonError, Transport, MAX_CHANNELS, MAX_CONNECTIONS};
