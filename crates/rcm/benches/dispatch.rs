//! The dispatcher: events per second delivered to callbacks (one id, and many ids over the
//! callback threads) and through an event channel. Events are made with `resolve_addr` to an
//! address no device reaches, which queues one `AddrError` at once and touches no network,
//! so what is measured is the call, the queueing and the delivery.
#![allow(missing_docs)] // criterion_group! generates an undocumented pub fn.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rcm::{Event, EventChannel, Fabric, FabricConfig, Flow, PortSpace};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const BATCH: u64 = 1000;

fn nowhere() -> SocketAddr {
    SocketAddr::new(IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1)), 1)
}

fn wait_for(count: &AtomicU64, n: u64) {
    while count.load(Ordering::Acquire) < n {
        std::hint::spin_loop();
    }
}

fn bench(c: &mut Criterion) {
    let f = Fabric::loopback_with(
        1,
        FabricConfig {
            udp_port: 47950,
            dispatcher_threads: 2,
            ..FabricConfig::default()
        },
    )
    .expect("device");
    let mut g = c.benchmark_group("dispatch");
    g.throughput(Throughput::Elements(BATCH));

    // One id: its callbacks run one at a time, in order.
    let seen = Arc::new(AtomicU64::new(0));
    let s = seen.clone();
    let one = f.create_id(PortSpace::Tcp, move |_, ev| {
        if matches!(ev, Event::AddrError(_)) {
            s.fetch_add(1, Ordering::Release);
        }
        Flow::Continue
    });
    g.bench_function("callbacks, one id", |b| {
        b.iter(|| {
            let start = seen.load(Ordering::Acquire);
            for _ in 0..BATCH {
                one.resolve_addr(None, nowhere()).expect("queued");
            }
            wait_for(&seen, start + BATCH);
        });
    });

    // 64 ids: callbacks of different ids run in parallel on the dispatcher threads.
    let seen64 = Arc::new(AtomicU64::new(0));
    let ids: Vec<_> = (0..64)
        .map(|_| {
            let s = seen64.clone();
            f.create_id(PortSpace::Tcp, move |_, ev| {
                if matches!(ev, Event::AddrError(_)) {
                    s.fetch_add(1, Ordering::Release);
                }
                Flow::Continue
            })
        })
        .collect();
    g.bench_function("callbacks, 64 ids", |b| {
        b.iter(|| {
            let start = seen64.load(Ordering::Acquire);
            for k in 0..BATCH as usize {
                ids[k % ids.len()]
                    .resolve_addr(None, nowhere())
                    .expect("queued");
            }
            wait_for(&seen64, start + BATCH);
        });
    });

    // An event channel: the caller takes (and acks) each event.
    let ch = EventChannel::new();
    let cid = f.create_id_on(PortSpace::Tcp, &ch);
    g.bench_function("event channel", |b| {
        b.iter(|| {
            for _ in 0..BATCH {
                cid.resolve_addr(None, nowhere()).expect("queued");
            }
            for _ in 0..BATCH {
                let e = ch
                    .get_event(Some(Duration::from_secs(5)))
                    .expect("an event");
                assert!(matches!(e.event(), Event::AddrError(_)));
            }
        });
    });
    g.finish();
    drop(one.destroy());
    for id in ids {
        drop(id.destroy());
    }
    drop(cid.destroy());
    f.shutdown();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
