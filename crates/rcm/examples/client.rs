//! A minimal rcm client in channel mode (librdmacm style): resolves, connects with private
//! data, establishes, waits for the server to disconnect, destroys.
//!
//! ```text
//! cargo run -p rcm --example client [SERVER_IP] [LOCAL_IP]
//! ```

use rcm::{ConnectOptions, Event, EventChannel, Fabric, FabricConfig, PortSpace};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server: IpAddr = std::env::args()
        .nth(1)
        .map_or(Ok(IpAddr::from([127, 0, 0, 1])), |s| s.parse())?;
    let local: IpAddr = std::env::args()
        .nth(2)
        .map_or(Ok(IpAddr::from([127, 0, 0, 2])), |s| s.parse())?;
    let fabric = Fabric::new(FabricConfig::default());
    fabric.add_device(local)?;
    let ch = EventChannel::new();
    let id = fabric.create_id_on(PortSpace::Tcp, &ch);
    id.resolve_addr(None, SocketAddr::new(server, 7471))?;
    loop {
        let Some(ev) = ch.get_event(Some(Duration::from_secs(30))) else {
            return Err("no event within 30 s".into());
        };
        match ev.event() {
            Event::AddrResolved => id.resolve_route()?,
            Event::RouteResolved => {
                id.connect(&ConnectOptions {
                    private_data: b"hello from rcm".to_vec(),
                    ..ConnectOptions::default()
                })?;
            }
            Event::ConnectResponse { private_data, .. } => {
                println!(
                    "client: server answered {:?}",
                    String::from_utf8_lossy(&private_data[..14])
                );
                id.establish()?;
            }
            Event::Established { .. } => println!("client: established"),
            Event::Disconnected => {
                println!("client: disconnected");
                break;
            }
            other => return Err(format!("client: unexpected {}", other.name()).into()),
        }
        // `ev` is dropped (acked) here: a destroy with events still held would be refused.
    }
    id.destroy()?;
    fabric.shutdown();
    Ok(())
}
