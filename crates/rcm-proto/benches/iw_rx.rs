//! The iWARP receive path of one established stream (`rcm_proto::iw::Cep::on_bytes`): a
//! 16 KiB read (the device's read size) packed with small Send FPDUs, the worst case for a
//! receive buffer that moved its remaining bytes after each FPDU. Criterion reports bytes
//! per second; the messages are taken out of the Cep each iteration so nothing accumulates.
#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use rcm_proto::iw::{AcceptParams, Cep, CepConfig, ConnectParams, Event};
use std::time::Instant;

/// Moves every byte each side sent to the other until nothing moves.
fn pump(a: &mut Cep, b: &mut Cep, now: Instant) {
    loop {
        let mut moved = false;
        while let Some(t) = a.poll_transmit() {
            a.transmitted(t.len());
            b.on_bytes(now, &t);
            moved = true;
        }
        while let Some(t) = b.poll_transmit() {
            b.transmitted(t.len());
            a.on_bytes(now, &t);
            moved = true;
        }
        if !moved {
            return;
        }
    }
}

/// Takes the Cep's events; the messages among them are taken by the application at once.
fn drain(c: &mut Cep) -> usize {
    let mut n = 0;
    while let Some(e) = c.poll_event() {
        n += usize::from(matches!(e, Event::Message(_)));
    }
    c.messages_taken(n);
    n
}

fn bench(c: &mut Criterion) {
    let now = Instant::now();
    let mut a = Cep::active(CepConfig::default());
    let mut b = Cep::passive(now, CepConfig::default());
    a.connect(now, &ConnectParams::default()).expect("connect");
    pump(&mut a, &mut b, now);
    b.accept(now, &AcceptParams::default()).expect("accept");
    pump(&mut a, &mut b, now);
    drain(&mut a);
    drain(&mut b);
    // 16 KiB of 1-byte Sends, as a peer could pack them; fresh ones (the next MSNs) for
    // every iteration, made outside the timing.
    let mut make_read = move || {
        let mut read = Vec::new();
        while read.len() < 16 << 10 {
            a.send(now, b"x").expect("send");
            while let Some(t) = a.poll_transmit() {
                read.extend_from_slice(&t);
            }
        }
        read
    };
    let first = make_read();
    let len = first.len();
    b.on_bytes(now, &first);
    let fpdus = drain(&mut b);
    assert!(fpdus > 500, "{fpdus} FPDUs in a read");
    let mut g = c.benchmark_group("iw_rx");
    g.throughput(Throughput::Bytes(len as u64));
    g.bench_function(format!("16KiB read of {fpdus} FPDUs"), |it| {
        it.iter_batched(
            &mut make_read,
            |read| {
                b.on_bytes(now, &read);
                let got = drain(&mut b);
                assert_eq!(got, fpdus, "the stream failed");
                got
            },
            BatchSize::SmallInput,
        );
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30);
    targets = bench
}
criterion_main!(benches);
