//! Sans-IO connection-manager engines for rcm.
//!
//! This crate will hold `ib::Endpoint` / `ib::Cep` (the IBTA chapter 12 CM state machine over
//! RoCEv2 MADs) and `iw::Cep` (the iWARP CM over an MPA byte stream). Nothing here does I/O:
//! datagrams, bytes and the current time go in; datagrams, timers and events come out. It is
//! built on the codecs of `rcm-wire` and has no threads, sockets, clocks or `unsafe`.
#![forbid(unsafe_code)]
