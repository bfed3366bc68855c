//! The `rcm` command.
fn main() {}
