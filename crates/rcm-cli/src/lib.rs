//! The library behind the `rcm` command: capture reading, frame building and the decoder.
//! The binary (`src/main.rs`) is a thin command-line layer over it.

pub mod bench;
pub mod capture;
pub mod decode;
pub mod netbuild;
pub mod ping;
pub mod stress;
