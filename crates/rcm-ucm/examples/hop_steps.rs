//! Where a connection cycle through the daemon spends its time, step by step: one thread
//! drives both ends (as the `hop` bench's cycle), through a one-address daemon started in
//! this process, and prints each step's median, mean and 90th percentile in µs.
//!
//! `cargo run --release -p rcm-ucm --example hop_steps -- [CYCLES] [--no-shm] [--one-session]`
//! (`--no-shm`: the daemon keeps command channels on their sockets; `--one-session`: both
//! ends' ids on one session, so one session reader instead of two polls beside the thread).

use rcm::{AcceptOptions, ConnectOptions, Event, EventChannel, PortSpace};
use rcm_ucm::{Daemon, DaemonConfig};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

const STEPS: [&str; 17] = [
    "create",
    "resolve_addr",
    "ADDR_RESOLVED",
    "resolve_route",
    "ROUTE_RESOLVED",
    "connect",
    "CONNECT_REQUEST",
    "accept",
    "CONNECT_RESPONSE",
    "establish",
    "ESTABLISHED (client)",
    "ESTABLISHED (server)",
    "disconnect",
    "DISCONNECTED (client)",
    "DISCONNECTED (server)",
    "destroy (client)",
    "destroy (server)",
];

fn next(ch: &EventChannel) -> Event {
    let mut e = ch
        .get_event(Some(Duration::from_secs(10)))
        .expect("an event");
    e.take().expect("the event")
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cycles: usize = args
        .iter()
        .find_map(|a| a.parse().ok())
        .unwrap_or(3000)
        .max(1);
    let ip = IpAddr::from([127, 0, 0, 1]);
    let sock = std::env::temp_dir().join(format!("rcm-hop-steps-{}.sock", std::process::id()));
    let mut dc = DaemonConfig::new(&sock, vec![ip]);
    dc.fabric.udp_port = 47991;
    dc.shared_memory = !args.iter().any(|a| a == "--no-shm");
    let d = Daemon::start(dc).expect("daemon");
    let server = rcm_ucm::fabric(d.socket()).expect("server session");
    let client = if args.iter().any(|a| a == "--one-session") {
        server.clone()
    } else {
        rcm_ucm::fabric(d.socket()).expect("client session")
    };
    let sch = EventChannel::new();
    let l = server.create_id_on(PortSpace::Tcp, &sch);
    let dst = SocketAddr::new(ip, 7999);
    l.bind(dst).expect("bind");
    l.listen(64).expect("listen");
    let mut times = vec![Vec::with_capacity(cycles); STEPS.len()];
    for _ in 0..cycles {
        let mut t = Instant::now();
        let mut k = 0;
        let mut step = |times: &mut Vec<Vec<f64>>| {
            let now = Instant::now();
            times[k].push((now - t).as_secs_f64() * 1e6);
            t = now;
            k += 1;
        };
        let cch = EventChannel::new();
        let c = client.create_id_on(PortSpace::Tcp, &cch);
        step(&mut times);
        c.resolve_addr(Some(ip), dst).expect("resolve_addr");
        step(&mut times);
        assert!(matches!(next(&cch), Event::AddrResolved));
        step(&mut times);
        c.resolve_route().expect("resolve_route");
        step(&mut times);
        assert!(matches!(next(&cch), Event::RouteResolved));
        step(&mut times);
        c.connect(&ConnectOptions::default()).expect("connect");
        step(&mut times);
        let req = sch
            .get_event(Some(Duration::from_secs(10)))
            .expect("request");
        let child = req.id().clone();
        drop(req);
        step(&mut times);
        child.accept(&AcceptOptions::default()).expect("accept");
        step(&mut times);
        assert!(matches!(next(&cch), Event::ConnectResponse { .. }));
        step(&mut times);
        c.establish().expect("establish");
        step(&mut times);
        assert!(matches!(next(&cch), Event::Established { .. }));
        step(&mut times);
        assert!(matches!(next(&sch), Event::Established { .. }));
        step(&mut times);
        c.disconnect().expect("disconnect");
        step(&mut times);
        assert!(matches!(next(&cch), Event::Disconnected));
        step(&mut times);
        assert!(matches!(next(&sch), Event::Disconnected));
        step(&mut times);
        c.destroy().expect("destroy");
        step(&mut times);
        child.destroy().expect("destroy");
        step(&mut times);
    }
    let mut total = 0.0;
    println!(
        "{:24} {:>8} {:>8} {:>8}   (µs, {cycles} cycles)",
        "step", "p50", "mean", "p90"
    );
    for (name, v) in STEPS.iter().zip(&mut times) {
        v.sort_by(f64::total_cmp);
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        total += mean;
        let at = |q: f64| v[((v.len() - 1) as f64 * q) as usize];
        println!("{name:24} {:8.1} {mean:8.1} {:8.1}", at(0.5), at(0.9));
    }
    println!("{:24} {:>8} {total:8.1}", "whole cycle", "");
    l.destroy().expect("destroy");
    server.shutdown();
    client.shutdown();
    d.shutdown();
}
