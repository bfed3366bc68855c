//! Errors of the rcm API. Every operation is either valid in the id's state or returns one of
//! these, having changed nothing.

use crate::id::State;
use rcm_proto::ib::CmError;

/// Why an rcm call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The operation is not valid in the id's current state.
    #[error("operation not valid in state {0:?}")]
    InvalidState(State),
    /// The id was destroyed (or is being destroyed).
    #[error("the id is destroyed")]
    Destroyed,
    /// The id's device was removed: only destroy is valid now.
    #[error("the device of this id was removed; only destroy is valid")]
    DeviceRemoved,
    /// No local device has this address, or none reaches the destination; or a bind or
    /// listen clashes with a wildcard binding of the port (either side a wildcard: Linux's
    /// -EADDRNOTAVAIL from `cma_check_port`); or, opening a device (RoCEv2 or iWARP), the
    /// host has no such address.
    #[error("address not available: {0}")]
    AddrNotAvailable(std::net::IpAddr),
    /// The port is already bound on this very address in this port space; or, opening a
    /// RoCEv2 device, its UDP port is another socket's.
    #[error("address in use: {0}")]
    AddrInUse(std::net::SocketAddr),
    /// No free port left in the ephemeral range.
    #[error("no free port in the ephemeral range")]
    NoPorts,
    /// Private data longer than the message allows.
    #[error("private data too long: {len} bytes, at most {max}")]
    PrivateDataTooLong {
        /// Bytes given.
        len: usize,
        /// The limit for this operation and transport.
        max: usize,
    },
    /// A blocking destroy would wait for channel events the caller still holds: drop (ack)
    /// them first, or use `begin_destroy`.
    #[error("{0} event(s) of this id are still held; ack them before a blocking destroy")]
    EventsOutstanding(usize),
    /// The QP is already connected or is being destroyed.
    #[error("the QP is in use: {0}")]
    QpBusy(std::borrow::Cow<'static, str>),
    /// A device with this address already exists.
    #[error("a device already serves {0}")]
    DeviceExists(std::net::IpAddr),
    /// An I/O error from the device's socket.
    #[error("I/O error: {0}")]
    Io(String),
    /// The protocol engine refused the command.
    #[error("protocol: {0}")]
    Protocol(#[from] CmError),
    /// An argument is invalid.
    #[error("invalid argument: {0}")]
    InvalidArgument(std::borrow::Cow<'static, str>),
    /// A per-client limit of the provider (the `rcm daemon`) was hit; nothing changed.
    #[error("limit reached: {0}")]
    LimitExceeded(crate::remote::Limit),
    /// The provider reported an error that has no closer meaning here.
    #[error("provider: {0}")]
    Remote(String),
    /// The fabric was shut down ([`crate::Fabric::shutdown`], or its last handle dropped):
    /// it makes no new ids or devices.
    #[error("the fabric is shut down")]
    ShutDown,
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}

/// Shorthand.
pub type Result<T, E = Error> = std::result::Result<T, E>;
