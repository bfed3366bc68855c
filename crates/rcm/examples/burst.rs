//! Many connections in flight at once on two loopback devices, with what each thread sends
//! batched: the issuing loop and the event loop hold a `SendBatch`, and the server's
//! callbacks run on its device thread (`CallbackMode::Inline`, for callbacks that never
//! block). Prints the rate and how many system calls carried several datagrams.
//!
//! ```text
//! cargo run --release -p rcm --example burst [CONNECTIONS] [UDP_PORT]
//! ```

use rcm::{
    AcceptOptions, CallbackMode, ConnectOptions, Event, EventChannel, Fabric, FabricConfig, Flow,
    PortSpace, SendBatch,
};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = std::env::args().nth(1).map_or(Ok(1000), |s| s.parse())?;
    let udp_port: u16 = std::env::args().nth(2).map_or(Ok(4791), |s| s.parse())?;
    let fabric = Fabric::new(FabricConfig {
        udp_port,
        callbacks: CallbackMode::Inline,
        ..FabricConfig::default()
    });
    let (server_ip, client_ip) = (IpAddr::from([127, 0, 0, 1]), IpAddr::from([127, 0, 0, 2]));
    let server_dev = fabric.add_device(server_ip)?;
    let client_dev = fabric.add_device(client_ip)?;

    // The server accepts every request and lets each connection go when it is disconnected.
    let listener = fabric.create_id(PortSpace::Tcp, |id, ev| match ev {
        Event::ConnectRequest { .. } => {
            if id.accept(&AcceptOptions::default()).is_ok() {
                Flow::Continue
            } else {
                Flow::Destroy
            }
        }
        Event::Disconnected | Event::DeviceRemoval => Flow::Destroy,
        _ => Flow::Continue,
    });
    let dst = SocketAddr::new(server_ip, 7471);
    listener.bind(dst)?;
    listener.listen(n.max(1024))?;

    let ch = EventChannel::new();
    let ids: Vec<_> = (0..n)
        .map(|_| fabric.create_id_on(PortSpace::Tcp, &ch))
        .collect();
    let start = Instant::now();
    // Every call's datagrams (none for resolving, a REQ per connect, an RTU per establish)
    // are held by this thread's batch and leave together: every 64, and whenever the loop
    // below is about to wait for an event with none queued.
    let batch = SendBatch::begin();
    for id in &ids {
        id.resolve_addr(Some(client_ip), dst)?;
    }
    let mut established = 0;
    while established < n {
        let Some(ev) = ch.get_event(Some(Duration::from_secs(30))) else {
            return Err(format!("stalled with {established} of {n} established").into());
        };
        let id = ev.id().clone();
        match ev.event() {
            Event::AddrResolved => id.resolve_route()?,
            Event::RouteResolved => id.connect(&ConnectOptions::default())?,
            Event::ConnectResponse { .. } => id.establish()?,
            Event::Established { .. } => established += 1,
            other => return Err(format!("unexpected {}", other.name()).into()),
        }
    }
    let elapsed = start.elapsed();
    // The last RTUs are still held: send them, and let them arrive before counting.
    SendBatch::flush();
    std::thread::sleep(Duration::from_millis(50));
    println!(
        "{n} connections established in {:.1} ms: {:.0} conn/s",
        elapsed.as_secs_f64() * 1e3,
        n as f64 / elapsed.as_secs_f64()
    );
    for (name, dev) in [("client", &client_dev), ("server", &server_dev)] {
        let (rx, tx) = dev.traffic();
        let (sends, receives) = dev.batched_io();
        println!(
            "{name} device: {tx} datagrams sent, {sends} sends carried several; {rx} received, {receives} receives brought several"
        );
    }
    for id in &ids {
        id.disconnect()?;
    }
    drop(batch);
    for id in ids {
        drop(id.destroy());
    }
    drop(listener.destroy());
    fabric.shutdown();
    Ok(())
}
