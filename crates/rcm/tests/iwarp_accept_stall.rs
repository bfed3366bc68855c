//! An iWARP listener whose accept fails for want of descriptors (EMFILE) comes back to the
//! connections waiting in its accept queue once descriptors are free again, without another
//! connection arriving to raise a new readiness edge. Alone in its test binary: it runs the
//! process out of descriptors for a moment. TCP port 27095 (listener), UDP 27096 (unused).
#![cfg(not(loom))]

mod common;

use common::{closed_within, ip};
use rcm::{Fabric, Flow, PortSpace};
use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

const PORT: u16 = 27095;

/// Opens files until the process has no descriptor left; they are freed when dropped.
fn exhaust_descriptors() -> Vec<std::fs::File> {
    let mut held = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => held.push(f),
            Err(e) => {
                assert_eq!(
                    e.raw_os_error(),
                    Some(libc::EMFILE),
                    "ran out of something else: {e}"
                );
                return held;
            }
        }
    }
}

#[test]
fn a_listener_out_of_descriptors_accepts_its_queue_once_they_are_back() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let f = Fabric::new(common::config(27096));
    f.add_iwarp_device(ip(1)).expect("iWARP device");
    let l = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    l.bind(SocketAddr::new(ip(1), PORT)).expect("bind");
    l.listen(8).expect("listen");

    // The client's socket exists before the descriptors run out; its connect needs none.
    let client = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
        .expect("client socket");
    // A low limit, so that running out takes a few dozen files, not a million.
    let before = getrlimit(Resource::Nofile);
    let open_now = std::fs::read_dir("/proc/self/fd").expect("/proc").count() as u64;
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(open_now + 32),
            maximum: before.maximum,
        },
    )
    .expect("lower the open-file limit");
    let held = exhaust_descriptors();
    client
        .connect(&SocketAddr::new(ip(1), PORT).into())
        .expect("TCP connect (the kernel completes it)");
    // The listener is told, tries to accept, and cannot.
    std::thread::sleep(Duration::from_millis(300));
    drop(held);
    setrlimit(Resource::Nofile, before).expect("restore the open-file limit");

    // Not MPA: once accepted, the stream is refused and closed. Before that, nothing
    // answers (the connection sits in the kernel's accept queue).
    let mut s: std::net::TcpStream = client.into();
    s.write_all(&[0x5a; 64]).expect("write");
    let closed = closed_within(s, Duration::from_secs(10)).is_some();
    assert!(
        closed,
        "the connection queued while descriptors ran out was never accepted"
    );
    l.destroy().expect("destroy");
    f.shutdown();
}
