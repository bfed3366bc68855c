//! The iWARP connection manager as a sans-IO engine: MPA (RFC 5044, enhanced by RFC 6581) over
//! one TCP byte stream, with the iw_cm's states and events.
//!
//! [`Cep`] is one connection endpoint over one *already established* TCP stream. The TCP
//! connect, listen and accept are the caller's (the rcm device driver's): the active side
//! builds a Cep with [`Cep::active`] once its TCP connect has succeeded and calls
//! [`Cep::connect`]; the passive side builds one with [`Cep::passive`] for every stream its
//! listening socket accepts. That is why no Cep is ever in [`State::Listen`].
//!
//! Feed it what the stream delivers ([`Cep::on_bytes`], any fragmentation), the end of the
//! stream ([`Cep::on_tcp_closed`]) and the time ([`Cep::on_timer`]); call its commands
//! ([`Cep::connect`], [`Cep::accept`], [`Cep::reject`], [`Cep::send`], [`Cep::disconnect`],
//! [`Cep::abort`], [`Cep::terminate`], [`Cep::destroy`]); drain [`Cep::poll_transmit`] (bytes to
//! write), [`Cep::poll_tcp_action`] (shut down, close or reset the socket once those bytes are
//! out), [`Cep::poll_event`] and [`Cep::poll_timeout`].
//!
//! # Events, in the iw_cm's terms
//!
//! - passive: [`Event::ConnectRequest`] (IW_CM_EVENT_CONNECT_REQUEST), then after `accept`
//!   [`Event::Established`] (IW_CM_EVENT_ESTABLISHED: the provider raises it once the Reply is
//!   queued, or in peer-to-peer mode once the initiator's RTR frame has arrived);
//! - active: [`Event::ConnectReply`] (IW_CM_EVENT_CONNECT_REPLY); `Accepted` is status 0 and
//!   means established (the iw_cm's `cm_conn_rep_handler` moves straight to ESTABLISHED and
//!   rdma_cm reports RDMA_CM_EVENT_ESTABLISHED; there is no separate ESTABLISHED upcall);
//!   `Rejected` is the peer's R flag and `Error` any other failure, after which nothing follows;
//! - both: [`Event::Message`] for each received Send, [`Event::Disconnect`] when the peer's FIN
//!   ends an established connection (IW_CM_EVENT_DISCONNECT), and [`Event::Close`]
//!   (IW_CM_EVENT_CLOSE) with a [`CloseReason`] as the last event.
//!
//! Every Cep that is not destroyed ends with exactly one terminal event (a non-accepting
//! `ConnectReply`, or `Close`) and one terminal [`TcpAction`] (`Close` or `Reset`); the one
//! exception is `reject`, which like `iw_cm_reject` generates no event. A destroyed Cep still
//! issues its terminal `TcpAction` (the socket must be released) but no event.
//!
//! # Timers (siw's values)
//!
//! The passive side waits 5 s for the MPA Request after the TCP accept (siw `MPAREP_TIMEOUT`),
//! the active side 10 s for the Reply after sending the Request (siw `MPAREQ_TIMEOUT`; the
//! names are the other way round in siw, its comment in `siw_cm.h` and `siw_cm_queue_work`
//! settle it, and the capture `e2-mpa-timeout` shows the 10 s). Nothing times out while the
//! user decides on a Request. Our own additions, so that nothing can hang: the RTR wait in
//! peer-to-peer mode and the wait for the peer's FIN after a local `disconnect`.
//!
//! # Errors
//!
//! A peer that breaks the protocol never makes the engine panic or wait forever: a bad key,
//! revision or length, garbage, private data over 256 bytes, markers, bytes where none may be,
//! a stream cut mid-frame, a bad CRC or an unacceptable DDP/RDMAP header each end the
//! connection with one error event ([`ProtocolError`]) and a close; after the MPA exchange (and
//! for a bad Reply key, as siw does) a Terminate (RFC 5040 §7) is sent first. A Request that
//! asks for markers, or an enhanced one too short for its IRD/ORD words, is first answered
//! with a reject Reply, as siw answers it.

mod buf;
mod cep;
mod types;

pub use buf::ByteQueue;
pub use cep::Cep;
pub use types::*;
