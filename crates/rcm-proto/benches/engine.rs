//! Engine benchmarks (being written).
fn main() {}
