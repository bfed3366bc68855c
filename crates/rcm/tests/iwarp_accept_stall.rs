//! An iWARP listener whose accept fails for want of descriptors (EMFILE) comes back to the
//! connections waiting in its accept queue once descriptors are free again, without another
//! connection arriving to raise a new readiness edge; and, accepting them in one pass, it
//! reads a stream's waiting MPA Request before it would give that stream up as silent.
//! In a test binary of their own: these tests run the process out of descriptors for a
//! moment (one at a time). TCP ports 27095, 27097 and 27098 (listeners), UDP 27096
//! (unused).
#![cfg(not(loom))]

mod common;

use common::{closed_within, ip};
use rcm::{Fabric, FabricConfig, Flow, PortSpace};
use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One test at a time: another one's setup needs descriptors.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Runs `f` while the process has no descriptor left (under a lowered open-file limit, so
/// that running out takes a few dozen files), then waits 300 ms for the listener to try its
/// accept and fail, and frees them.
fn without_descriptors(f: impl FnOnce()) {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
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
                break;
            }
        }
    }
    f();
    std::thread::sleep(Duration::from_millis(300));
    drop(held);
    setrlimit(Resource::Nofile, before).expect("restore the open-file limit");
}

/// A client socket made before the descriptors run out (its connect needs none).
fn tcp_socket() -> socket2::Socket {
    socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket")
}

/// A client's MPA Request, as a sans-IO initiator makes it.
fn mpa_request() -> Vec<u8> {
    use rcm_proto::iw::{Cep, CepConfig, ConnectParams};
    let mut cep = Cep::active(CepConfig::default());
    cep.connect(Instant::now(), &ConnectParams::default())
        .expect("an MPA Request");
    std::iter::from_fn(|| cep.poll_transmit())
        .flatten()
        .collect()
}

#[test]
fn a_listener_out_of_descriptors_accepts_its_queue_once_they_are_back() {
    const PORT: u16 = 27095;
    let _one = one_at_a_time();
    let f = Fabric::new(common::config(27096));
    f.add_iwarp_device(ip(1)).expect("iWARP device");
    let l = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    l.bind(SocketAddr::new(ip(1), PORT)).expect("bind");
    l.listen(8).expect("listen");
    let client = tcp_socket();
    without_descriptors(|| {
        client
            .connect(&SocketAddr::new(ip(1), PORT).into())
            .expect("TCP connect (the kernel completes it)");
    });
    // Not MPA: once accepted, the stream is refused and closed. Before that, nothing
    // answers (the connection sits in the kernel's accept queue).
    let mut s: std::net::TcpStream = client.into();
    s.write_all(&[0x5a; 64]).expect("write");
    assert!(
        closed_within(s, Duration::from_secs(10)).is_some(),
        "the connection queued while descriptors ran out was never accepted"
    );
    l.destroy().expect("destroy");
    f.shutdown();
}

/// With room for one silent stream, two connections accepted in one pass (both queued while
/// descriptors ran out): the first has sent its MPA Request, the second nothing. Taking the
/// second puts the first over the half-open budget, and its waiting Request is read before
/// it would be reset as silent: it reaches the listener as a connect request.
#[test]
fn a_waiting_request_is_read_before_its_stream_is_given_up_as_silent() {
    const PORT: u16 = 27097;
    let _one = one_at_a_time();
    let f = Fabric::new(FabricConfig {
        max_half_open: 1,
        ..common::config(27096)
    });
    f.add_iwarp_device(ip(1)).expect("iWARP device");
    let (l, requests) = common::counting_listener(&f, SocketAddr::new(ip(1), PORT), 8);
    let request = mpa_request();
    let (speaks, silent) = (tcp_socket(), tcp_socket());
    let to = SocketAddr::new(ip(1), PORT).into();
    without_descriptors(|| {
        speaks.connect(&to).expect("TCP connect");
        (&speaks).write_all(&request).expect("the MPA Request");
        silent.connect(&to).expect("TCP connect");
    });
    let t0 = Instant::now();
    while requests.load(Ordering::SeqCst) == 0 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        requests.load(Ordering::SeqCst),
        1,
        "the Request waiting in the first stream was never read (the stream was reset as silent)"
    );
    drop((speaks, silent));
    l.destroy().expect("destroy");
    f.shutdown();
}

/// Streams that say nothing cannot keep a client out by holding every descriptor the
/// process may open: a listener out of descriptors resets its oldest silent streams, as past
/// its half-open bound, and takes the connections waiting. Here 8 descriptors are left for
/// 40 silent connections and then one that sends its MPA Request, with an MPA Request
/// timeout of a minute: before, the listener held the first 8 silent streams and retried
/// its accept every 50 ms for that minute, the speaking client never taken.
#[test]
fn silent_streams_give_their_descriptors_up_to_a_client_that_speaks() {
    use rcm_proto::iw::CepConfig;
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    const PORT: u16 = 27098;
    let _one = one_at_a_time();
    let f = Fabric::new(common::config(27096));
    f.add_iwarp_device_with(
        ip(1),
        CepConfig {
            mpa_request_timeout: Duration::from_secs(60),
            ..CepConfig::default()
        },
    )
    .expect("iWARP device");
    let (l, requests) = common::counting_listener(&f, SocketAddr::new(ip(1), PORT), 64);
    let request = mpa_request();
    let silent: Vec<_> = (0..40).map(|_| tcp_socket()).collect();
    let speaks = tcp_socket();
    let to = SocketAddr::new(ip(1), PORT).into();
    let before = getrlimit(Resource::Nofile);
    let open_now = std::fs::read_dir("/proc/self/fd").expect("/proc").count() as u64;
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(open_now + 8),
            maximum: before.maximum,
        },
    )
    .expect("lower the open-file limit");
    for s in &silent {
        s.connect(&to)
            .expect("TCP connect (the kernel completes it)");
    }
    std::thread::sleep(Duration::from_millis(200));
    speaks.connect(&to).expect("TCP connect");
    (&speaks).write_all(&request).expect("the MPA Request");
    let t0 = Instant::now();
    while requests.load(Ordering::SeqCst) == 0 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    setrlimit(Resource::Nofile, before).expect("restore the open-file limit");
    assert_eq!(
        requests.load(Ordering::SeqCst),
        1,
        "the speaking client was never taken: silent streams held the descriptors"
    );
    drop((silent, speaks));
    l.destroy().expect("destroy");
    f.shutdown();
}
