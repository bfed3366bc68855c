//! What rcm itself spends on a connection, with the network taken out (see
//! `processing/cycle.rs`): a whole connect, accept, establish and disconnect on one thread
//! without a system call. A serial connect on loopback costs this plus the UDP round trip
//! (`rcm bench --serial`). For instruction counts, which do not drift with the machine's
//! mood, see `examples/cycles.rs`.
#![allow(missing_docs)] // criterion_group! generates an undocumented pub fn.

#[path = "processing/cycle.rs"]
mod cycle;

use criterion::{criterion_group, criterion_main, Criterion};
use std::time::Duration;

fn bench(c: &mut Criterion) {
    let bed = cycle::Bed::new(47960);
    let mut g = c.benchmark_group("processing");
    g.bench_function("connect to established, one thread", |b| {
        b.iter_custom(|n| (0..n).map(|_| cycle::cycle(&bed)).sum());
    });
    g.bench_function("whole cycle, one thread", |b| b.iter(|| cycle::cycle(&bed)));
    g.finish();
    bed.shutdown();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
