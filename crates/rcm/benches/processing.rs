//! What rcm itself spends on a connection, with the network taken out: one RoCEv2 device
//! whose datagrams to its own address go straight to its engine (`FabricConfig::loopback`),
//! and every callback run on the calling thread (`CallbacksHere`), so that a whole connect,
//! accept, establish and disconnect happens on one thread without a system call. A serial
//! connect on loopback costs this plus the UDP round trip (`rcm bench --serial`).
#![allow(missing_docs)] // criterion_group! generates an undocumented pub fn.

use criterion::{criterion_group, criterion_main, Criterion};
use rcm::{
    AcceptOptions, CallbackMode, CallbacksHere, CmId, ConnectOptions, Event, EventChannel, Fabric,
    FabricConfig, Flow, PortSpace, QpState,
};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

const PORT: u16 = 7471;

fn ip() -> IpAddr {
    IpAddr::from([127, 0, 0, 1])
}

fn next(ch: &EventChannel) -> Event {
    let mut e = ch.get_event(Some(Duration::from_secs(5))).expect("event");
    e.take().expect("event")
}

/// One connection from resolution to destruction; returns the time from `connect` to
/// ESTABLISHED (what `rcm bench` calls connect latency), the steps `rcm bench` takes between
/// them included (the QP attributes, `establish`).
fn cycle(f: &Fabric, ch: &EventChannel) -> Duration {
    let id: CmId = f.create_id_on(PortSpace::Tcp, ch);
    id.resolve_addr(Some(ip()), SocketAddr::new(ip(), PORT))
        .expect("resolve");
    assert!(matches!(next(ch), Event::AddrResolved));
    id.resolve_route().expect("route");
    assert!(matches!(next(ch), Event::RouteResolved));
    let t = Instant::now();
    {
        let _here = CallbacksHere::begin();
        id.connect(&ConnectOptions {
            private_data: b"rcm bench connect".to_vec(),
            ..ConnectOptions::default()
        })
        .expect("connect");
    }
    assert!(matches!(next(ch), Event::ConnectResponse { .. }));
    let _ = id.init_qp_attr(QpState::Rtr);
    let _ = id.init_qp_attr(QpState::Rts);
    {
        let _here = CallbacksHere::begin();
        id.establish().expect("establish");
    }
    assert!(matches!(next(ch), Event::Established { .. }));
    let took = t.elapsed();
    {
        let _here = CallbacksHere::begin();
        id.disconnect().expect("disconnect");
    }
    assert!(matches!(next(ch), Event::Disconnected));
    let _here = CallbacksHere::begin();
    id.destroy().expect("destroy");
    took
}

fn bench(c: &mut Criterion) {
    let f = Fabric::loopback_with(
        1,
        FabricConfig {
            udp_port: 47960,
            callbacks: CallbackMode::Inline,
            ..FabricConfig::default()
        },
    )
    .expect("device");
    let l = f.create_id(PortSpace::Tcp, |id, ev| match ev {
        Event::ConnectRequest { .. } => {
            let opts = AcceptOptions {
                private_data: b"rcm bench accept".to_vec(),
                ..AcceptOptions::default()
            };
            if id.accept(&opts).is_err() {
                return Flow::Destroy;
            }
            Flow::Continue
        }
        Event::Disconnected => Flow::Destroy,
        _ => Flow::Continue,
    });
    l.bind(SocketAddr::new(ip(), PORT)).expect("bind");
    l.listen(1024).expect("listen");
    let ch = EventChannel::new();
    let mut g = c.benchmark_group("processing");
    g.bench_function("connect to established, one thread", |b| {
        b.iter_custom(|n| (0..n).map(|_| cycle(&f, &ch)).sum());
    });
    g.bench_function("whole cycle, one thread", |b| b.iter(|| cycle(&f, &ch)));
    g.finish();
    let _ = l.destroy();
    f.shutdown();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
