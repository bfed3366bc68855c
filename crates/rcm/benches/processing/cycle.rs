//! One connection's whole life on one thread, with the network taken out: one RoCEv2 device
//! whose datagrams to its own address go straight to its engine (`FabricConfig::loopback`),
//! every callback run on the calling thread (`CallbacksHere`). Shared by the criterion bench
//! (`benches/processing.rs`) and the instruction-count harness (`examples/cycles.rs`).

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

/// A one-device loopback fabric on `udp_port` with an accepting listener, and the channel
/// the client ids use.
pub struct Bed {
    pub fabric: Fabric,
    pub channel: EventChannel,
    listener: CmId,
}

impl Bed {
    pub fn new(udp_port: u16) -> Self {
        let fabric = Fabric::loopback_with(
            1,
            FabricConfig {
                udp_port,
                callbacks: CallbackMode::Inline,
                ..FabricConfig::default()
            },
        )
        .expect("device");
        let listener = fabric.create_id(PortSpace::Tcp, |id, ev| match ev {
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
        listener.bind(SocketAddr::new(ip(), PORT)).expect("bind");
        listener.listen(1024).expect("listen");
        Bed {
            fabric,
            channel: EventChannel::new(),
            listener,
        }
    }

    pub fn shutdown(self) {
        let _ = self.listener.destroy();
        self.fabric.shutdown();
    }
}

/// One connection from resolution to destruction; returns the time from `connect` to
/// ESTABLISHED (what `rcm bench` calls connect latency), the steps `rcm bench` takes between
/// them included (the QP attributes, `establish`).
#[inline(never)]
pub fn cycle(bed: &Bed) -> Duration {
    let (f, ch) = (&bed.fabric, &bed.channel);
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
