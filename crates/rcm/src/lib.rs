//! rcm: the connection-manager library applications use.
//!
//! This crate will hold `Device`, `CmId`, `EventChannel`, callbacks with serialized delivery,
//! blocking and non-blocking destroy, device removal, the RoCEv2 (UDP 4791) and iWARP (TCP)
//! drivers, and the rdma_cm layer (address and route resolution, port spaces, listen,
//! connect, accept, reject, disconnect, QP attribute hand-off), driving the sans-IO engines of
//! `rcm-proto`.
