//! Byte-exact codecs for RDMA connection management.
//!
//! In the smoltcp idiom: a checked view over bytes where a view helps, and a plain `Repr`
//! you can build, `parse` and `emit`. Every decoder returns [`WireError`] for malformed input
//! and never panics; every encoder produces the bytes Linux puts on the wire (see the golden
//! vectors in `tests/`). No I/O, no clocks, no `unsafe`.
//!
//! - [`roce`]: RoCEv2 BTH, DETH, the ICRC, and whole GSI datagrams (UDP port 4791).
//! - [`mad`]: the 24-byte MAD common header.
//! - [`cm`]: the IB CM messages (IBTA Vol 1 chapter 12) and ClassPortInfo.
//! - [`cma`]: the rdma_cm private-data header, port spaces and service IDs.
//! - [`mpa`]: iWARP MPA request/reply frames (RFC 5044 / RFC 6581), FPDUs, DDP/RDMAP.
//! - [`tid`]: Linux's construction of CM transaction IDs.
#![forbid(unsafe_code)]

pub mod bits;
pub mod cm;
pub mod cma;
mod error;
mod gid;
pub mod mad;
pub mod mpa;
pub mod roce;
pub mod tid;

pub(crate) use error::need;
pub use error::{Result, WireError};
pub use gid::Gid;
