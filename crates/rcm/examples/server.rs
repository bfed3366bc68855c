//! A minimal rcm server with callbacks: accepts connections on 127.0.0.1:7471 (or the address
//! given), echoes the client's private data in the REP, and disconnects each connection once
//! it is established.
//!
//! ```text
//! cargo run -p rcm --example server [IP] [COUNT]      # then: cargo run -p rcm --example client
//! ```

use rcm::{AcceptOptions, Event, Fabric, FabricConfig, Flow, PortSpace};
use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ip: IpAddr = std::env::args()
        .nth(1)
        .map_or(Ok(IpAddr::from([127, 0, 0, 1])), |s| s.parse())?;
    let count: usize = std::env::args().nth(2).map_or(Ok(1), |s| s.parse())?;
    let fabric = Fabric::new(FabricConfig::default());
    fabric.add_device(ip)?;
    let (done_tx, done_rx) = mpsc::channel();
    let listener = fabric.create_id(PortSpace::Tcp, move |id, ev| match ev {
        Event::ConnectRequest {
            private_data,
            param,
            ..
        } => {
            println!(
                "server: request from {:?}, QPN {:#x}",
                id.peer_addr(),
                param.qpn
            );
            let used = private_data
                .iter()
                .rposition(|&b| b != 0)
                .map_or(0, |i| i + 1);
            let echo = AcceptOptions {
                private_data: private_data[..used].to_vec(),
                ..AcceptOptions::default()
            };
            // Returning Destroy rejects the request (the child id goes away).
            if id.accept(&echo).is_ok() {
                Flow::Continue
            } else {
                Flow::Destroy
            }
        }
        Event::Established { .. } => {
            println!("server: established with {:?}", id.peer_addr());
            let _ = id.disconnect();
            Flow::Continue
        }
        Event::Disconnected => {
            println!("server: disconnected");
            let _ = done_tx.send(());
            Flow::Destroy
        }
        other => {
            println!("server: {}", other.name());
            Flow::Continue
        }
    });
    listener.bind(SocketAddr::new(ip, 7471))?;
    listener.listen(0)?;
    println!("server: listening on {ip}:7471");
    for _ in 0..count {
        done_rx.recv()?;
    }
    listener.destroy()?;
    fabric.shutdown();
    Ok(())
}
