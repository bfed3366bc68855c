//! rcm-ucm: user-space access to a host's CM ports.
//!
//! This crate will hold the `rcm daemon` server that owns the devices of a host address and
//! serves many processes over a Unix socket with a small versioned binary protocol modelled on
//! the kernel's ucma, and the client library that implements the `rcm` API over that socket.
