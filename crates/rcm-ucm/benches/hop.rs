//! What the daemon hop costs: one command round trip (`state()` = Query) through the daemon
//! against the same call in-process, 64 calls in a row (and 64 creates and destroys) with
//! and without an `rcm::Pipeline`, an operation with its event, and a whole
//! connect/accept/disconnect cycle both ways.
#![allow(missing_docs)] // criterion's macros generate undocumented items

use criterion::{criterion_group, criterion_main, Criterion};
use rcm::{AcceptOptions, ConnectOptions, Event, EventChannel, Fabric, FabricConfig, PortSpace};
use rcm_ucm::{Daemon, DaemonConfig};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

fn ip(last: u8) -> IpAddr {
    IpAddr::from([127, 0, 0, last])
}

fn cfg(port: u16) -> FabricConfig {
    FabricConfig {
        udp_port: port,
        ..FabricConfig::default()
    }
}

fn wait(ch: &EventChannel) -> Event {
    let mut e = ch
        .get_event(Some(Duration::from_secs(10)))
        .expect("event within 10 s");
    e.take().expect("event")
}

/// One connect → accept → establish → disconnect cycle between a server and a client id
/// (the client on device `src` and the server there too, or the server on 127.0.0.1 and the
/// client on the other device when `None`).
fn cycle(client: &Fabric, sch: &EventChannel, port: u16, src: Option<IpAddr>) {
    let cch = EventChannel::new();
    let c = client.create_id_on(PortSpace::Tcp, &cch);
    c.resolve_addr(src, SocketAddr::new(src.unwrap_or(ip(1)), port))
        .unwrap();
    assert!(matches!(wait(&cch), Event::AddrResolved));
    c.resolve_route().unwrap();
    assert!(matches!(wait(&cch), Event::RouteResolved));
    c.connect(&ConnectOptions::default()).unwrap();
    let req = sch
        .get_event(Some(Duration::from_secs(10)))
        .expect("request");
    let child = req.id().clone();
    drop(req);
    child.accept(&AcceptOptions::default()).unwrap();
    assert!(matches!(wait(&cch), Event::ConnectResponse { .. }));
    c.establish().unwrap();
    assert!(matches!(wait(&cch), Event::Established { .. }));
    assert!(matches!(wait(sch), Event::Established { .. }));
    c.disconnect().unwrap();
    assert!(matches!(wait(&cch), Event::Disconnected));
    assert!(matches!(wait(sch), Event::Disconnected));
    c.destroy().unwrap();
    child.destroy().unwrap();
}

fn bench(c: &mut Criterion) {
    let sock = std::env::temp_dir().join(format!("rcm-ucm-bench-{}.sock", std::process::id()));
    let mut dc = DaemonConfig::new(&sock, vec![ip(1), ip(2)]);
    dc.fabric = cfg(47901);
    let d = Daemon::start(dc).expect("daemon");
    let remote_s = rcm_ucm::fabric(d.socket()).expect("session");
    let remote_c = rcm_ucm::fabric(d.socket()).expect("session");
    let local = Fabric::loopback_with(2, cfg(47902)).expect("devices");
    // The same daemon with its command channels kept on their sockets (`--no-shm`).
    let sock2 = std::env::temp_dir().join(format!("rcm-ucm-bench2-{}.sock", std::process::id()));
    let mut dc = DaemonConfig::new(&sock2, vec![ip(3)]);
    dc.fabric = cfg(47903);
    dc.shared_memory = false;
    let d2 = Daemon::start(dc).expect("daemon");
    let sock_s = rcm_ucm::fabric(d2.socket()).expect("session");
    let sock_c = rcm_ucm::fabric(d2.socket()).expect("session");

    let mut g = c.benchmark_group("hop");
    let lid = local.create_id_on(PortSpace::Tcp, &EventChannel::new());
    g.bench_function("query in-process", |b| b.iter(|| lid.state()));
    let rid = remote_c.create_id_on(PortSpace::Tcp, &EventChannel::new());
    g.bench_function("query through daemon", |b| b.iter(|| rid.state()));
    let sid = sock_c.create_id_on(PortSpace::Tcp, &EventChannel::new());
    g.bench_function("query through daemon, socket channels", |b| {
        b.iter(|| sid.state());
    });
    g.bench_function("create+destroy id through daemon", |b| {
        b.iter(|| {
            let id = remote_c.create_id_on(PortSpace::Tcp, &EventChannel::new());
            id.destroy().unwrap();
        });
    });

    // 64 calls in a row that the daemon refuses (a route before the address): each waits
    // for its answer, or, in an `rcm::Pipeline`, the lot waits once when it ends and the
    // refusals come as ROUTE_ERROR events (taken here too).
    let rch = EventChannel::new();
    let refused: Vec<_> = (0..64)
        .map(|_| remote_c.create_id_on(PortSpace::Tcp, &rch))
        .collect();
    g.bench_function("64 calls through daemon", |b| {
        b.iter(|| {
            for id in &refused {
                assert!(id.resolve_route().is_err());
            }
        });
    });
    // Timed until the pipeline has ended (every answer read, each refusal queued as its
    // event); taking the events from the channel is not.
    g.bench_function("64 calls through daemon, pipelined", |b| {
        b.iter_custom(|iters| {
            let mut t = Duration::ZERO;
            for _ in 0..iters {
                let t0 = std::time::Instant::now();
                {
                    let _p = rcm::Pipeline::begin();
                    for id in &refused {
                        id.resolve_route().unwrap();
                    }
                }
                t += t0.elapsed();
                for _ in &refused {
                    assert!(matches!(wait(&rch), Event::RouteError(_)));
                }
            }
            t
        });
    });
    for id in refused {
        id.destroy().unwrap();
    }
    // 64 ids created and destroyed in a row: one by one each call waits for its answer; in
    // a pipeline the client names the handles, and neither the creates nor the destroys
    // (with no callback in flight) wait, the lot awaited when the pipeline ends.
    // With a bind each (an ephemeral port): in a pipeline the binds do not wait either.
    for (name, pipelined, bind) in [
        ("64 creates+destroys through daemon", false, false),
        ("64 creates+destroys through daemon, pipelined", true, false),
        ("64 creates+binds+destroys through daemon", false, true),
        (
            "64 creates+binds+destroys through daemon, pipelined",
            true,
            true,
        ),
    ] {
        let ch = EventChannel::new();
        g.bench_function(name, |b| {
            b.iter(|| {
                let _p = pipelined.then(rcm::Pipeline::begin);
                let ids: Vec<_> = (0..64)
                    .map(|_| remote_c.try_create_id_on(PortSpace::Tcp, &ch).unwrap())
                    .collect();
                if bind {
                    for id in &ids {
                        id.bind(SocketAddr::new(ip(2), 0)).unwrap();
                    }
                }
                for id in ids {
                    id.destroy().unwrap();
                }
            });
        });
    }

    // An operation whose event the daemon produces at once: the event's own cost through
    // the hop (compare with create+destroy).
    for (name, f) in [
        ("create+resolve_addr+event+destroy in-process", &local),
        (
            "create+resolve_addr+event+destroy through daemon",
            &remote_c,
        ),
    ] {
        let ch = EventChannel::new();
        g.bench_function(name, |b| {
            b.iter(|| {
                let id = f.create_id_on(PortSpace::Tcp, &ch);
                id.resolve_addr(None, SocketAddr::new(ip(1), 7800)).unwrap();
                assert!(matches!(wait(&ch), Event::AddrResolved));
                id.destroy().unwrap();
            });
        });
    }

    // Two devices cross UDP; on one device the daemon's loopback carries the CM messages
    // (rcm::FabricConfig::loopback).
    for (name, s, cl, port, src) in [
        ("cycle in-process", &local, &local, 7801u16, None),
        (
            "cycle in-process, one device",
            &local,
            &local,
            7804,
            Some(ip(1)),
        ),
        ("cycle through daemon", &remote_s, &remote_c, 7802, None),
        (
            "cycle through daemon, one device",
            &remote_s,
            &remote_c,
            7803,
            Some(ip(1)),
        ),
        (
            "cycle through daemon, one device, socket channels",
            &sock_s,
            &sock_c,
            7805,
            Some(ip(3)),
        ),
    ] {
        let sch = EventChannel::new();
        let l = s.create_id_on(PortSpace::Tcp, &sch);
        l.bind(SocketAddr::new(src.unwrap_or(ip(1)), port)).unwrap();
        l.listen(64).unwrap();
        g.bench_function(name, |b| b.iter(|| cycle(cl, &sch, port, src)));
        l.destroy().unwrap();
    }
    g.finish();
    lid.destroy().unwrap();
    rid.destroy().unwrap();
    sid.destroy().unwrap();
    sock_s.shutdown();
    sock_c.shutdown();
    d2.shutdown();
    remote_s.shutdown();
    remote_c.shutdown();
    local.shutdown();
    d.shutdown();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
