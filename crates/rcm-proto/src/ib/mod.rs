//! The IB CM (IBTA Vol 1 chapter 12) as a sans-IO engine over RoCEv2 MADs.
//!
//! [`Endpoint`] is one CM port. Feed it received MADs (`handle_datagram`) and the time
//! (`handle_timeout`); call its commands (`connect`, `listen`, `accept`, `reject`, `mra`,
//! `establish`, `disconnect`, `sidr_request`, `sidr_reply`, `destroy`); drain
//! `poll_transmit`, `poll_event` and `poll_timeout`.

mod cep;
mod endpoint;
mod peers;
mod timers;
mod types;

pub use cep::State;
pub use endpoint::{Endpoint, Stats, DEFAULT_BACKLOG, MAX_TIMEWAIT};
pub use types::*;
