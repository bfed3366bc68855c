//! Command channels in shared memory (`MAP_CHANNEL`, §2.2 of `docs/ucm-protocol.md`): the
//! client library maps its channels by default and its calls work through the rings; a
//! daemon that declines keeps them on their sockets; and whatever a client writes into the
//! memory it shares with the daemon (indices out of range, frames that lie about their
//! length, random bytes, valid commands) ends at most that channel, never the daemon.

mod common;

use common::*;
use rand::{rngs::StdRng, Rng, SeedableRng};
use rcm::remote::Reply;
use rcm_shm::{Consumer, Producer, Region};
use rcm_ucm::proto::{self, Answer, Command, Header, Message};
use rcm_ucm::shmchan::{ANSWERS, COMMANDS};
use rcm_ucm::{Client, Daemon};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A raw channel of the session holding `token`, mapped: the channel (its socket is the
/// doorbell) and the shared memory.
fn mapped(d: &Daemon, token: u64) -> (rcm_ucm::raw::RawSession, Arc<Region>) {
    let mut c = channel(d, token);
    let (m, region) = c.map_channel().expect("map");
    assert_eq!(m, Message::Ok(Answer::Reply(Reply::Done)), "mapped");
    (
        c,
        Arc::new(region.expect("the memory came with the answer")),
    )
}

/// A raw mapped channel's two rings as the client uses them: its commands producer and
/// its answers consumer, with the channel (its socket is the doorbell).
fn mapped_rings(d: &Daemon, token: u64) -> (rcm_ucm::raw::RawSession, Producer, Consumer) {
    let (c, region) = mapped(d, token);
    let tx = Producer::new(region.clone(), COMMANDS).expect("producer");
    let rx = Consumer::new(region, ANSWERS).expect("consumer");
    (c, tx, rx)
}

/// One command through a mapped ring, as the client library sends it; its answer.
fn ring_call(
    tx: &mut Producer,
    rx: &mut Consumer,
    doorbell: &mut rcm_ucm::raw::RawSession,
    cmd: &Command,
    seq: u32,
) -> Message {
    ring_call_within(tx, rx, doorbell, cmd, seq, T).expect("nothing came in the ring")
}

/// `ring_call`, or `None` when no answer comes within `wait`.
fn ring_call_within(
    tx: &mut Producer,
    rx: &mut Consumer,
    doorbell: &mut rcm_ucm::raw::RawSession,
    cmd: &Command,
    seq: u32,
    wait: Duration,
) -> Option<Message> {
    if tx.push(&cmd.encode(seq)).expect("push").expect("room") {
        doorbell.send_bytes(&[1]).expect("doorbell");
    }
    let (got, m) = next_frame_within(rx, wait)?;
    assert_eq!(got, seq);
    Some(m)
}

/// A session of `d`, a fabric on it, and an id on a channel bound to 127.0.0.1:`port` (the
/// bind's answer checked).
fn bound(d: &Daemon, port: u16) -> (Client, rcm::Fabric, rcm::EventChannel, rcm::CmId) {
    let client = Client::connect(d.socket()).expect("session");
    let f = rcm::Fabric::with_provider(Arc::new(client.clone()), rcm::FabricConfig::default());
    let ch = rcm::EventChannel::new();
    let id = f.create_id_on(rcm::PortSpace::Tcp, &ch);
    id.bind(sa(1, port)).expect("bind");
    assert_eq!(id.local_addr(), Some(sa(1, port)), "the daemon's answer");
    (client, f, ch, id)
}

#[test]
fn a_clients_calls_go_through_shared_memory_by_default() {
    let d = daemon("shm-default", 49301, &[1]);
    let (client, f, ch, id) = bound(&d, 7301);
    assert!(client.mapped_channels() >= 1, "no channel was mapped");
    assert_eq!(d.mapped_channels(), client.mapped_channels() as u64);
    // A whole connection (calls and their events) between two clients of the daemon.
    round_trip(&d, sa(1, 7302));
    assert!(d.mapped_channels() >= 3, "{} mapped", d.mapped_channels());
    // Many calls from several threads at once: each takes a channel of its own.
    let ids: Vec<_> = (0..4)
        .map(|_| f.create_id_on(rcm::PortSpace::Tcp, &ch))
        .collect();
    std::thread::scope(|s| {
        for (k, id) in ids.iter().enumerate() {
            s.spawn(move || {
                for _ in 0..500 {
                    assert_eq!(id.state(), rcm::State::Idle, "id {k}");
                }
            });
        }
    });
    assert_eq!(id.destroy(), Ok(rcm::DestroyOutcome::Done));
    for id in ids {
        assert_eq!(id.destroy(), Ok(rcm::DestroyOutcome::Done));
    }
    f.shutdown();
    wait_ids(&d, 0, 0);
}

#[test]
fn a_daemon_that_keeps_channels_on_sockets_serves_as_before() {
    let mut cfg = config("shm-off", 49302, &[1]);
    cfg.shared_memory = false;
    let d = Daemon::start(cfg).expect("daemon");
    let (_s, token) = raw(&d);
    let mut c = channel(&d, token);
    let (m, region) = c.map_channel().expect("map");
    assert!(matches!(m, Message::Err(_)), "{m:?}");
    assert!(region.is_none(), "memory sent with a refusal");
    // The refused channel still answers on its socket.
    assert!(matches!(ok(&mut c, &Command::Devices), Answer::Devices(_)));
    let (client, f, _ch, id) = bound(&d, 7303);
    assert_eq!(client.mapped_channels(), 0);
    round_trip(&d, sa(1, 7304));
    assert_eq!(d.mapped_channels(), 0);
    assert_eq!(id.destroy(), Ok(rcm::DestroyOutcome::Done));
    f.shutdown();
}

/// A command over the daemon's message limit is answered `LimitExceeded(MessageSize)` on a
/// mapped channel as on a socket, and the channel goes on; one too long for the ring is
/// refused so by the client library itself (the daemon maps only when its limit fits).
#[test]
fn an_oversized_command_on_a_mapped_channel_is_a_typed_error() {
    let limits = proto::Limits {
        max_message: 64,
        ..proto::Limits::default()
    };
    let d = daemon_with_limits("shm-big", 49307, &[1], limits);
    let (_s, token) = raw(&d);
    let (mut c, mut tx, mut rx) = mapped_rings(&d, token);
    let big = Command::Call(
        1,
        rcm::remote::Op::Connect(rcm::ConnectOptions {
            private_data: vec![7; 100],
            ..rcm::ConnectOptions::default()
        }),
    );
    let m = ring_call(&mut tx, &mut rx, &mut c, &big, 3);
    assert_eq!(
        m,
        Message::Err(proto::WireError::Cm(rcm::Error::LimitExceeded(
            rcm::remote::Limit::MessageSize
        )))
    );
    let m = ring_call(&mut tx, &mut rx, &mut c, &Command::Devices, 4);
    assert!(matches!(m, Message::Ok(Answer::Devices(_))), "{m:?}");
    // Through the client library: a frame longer than the ring never reaches it.
    let (client, _f, _ch, id) = bound(&d, 7308);
    assert!(client.mapped_channels() >= 1);
    let r = id.connect(&rcm::ConnectOptions {
        private_data: vec![1; 70_000],
        ..rcm::ConnectOptions::default()
    });
    assert_eq!(
        r,
        Err(rcm::Error::LimitExceeded(rcm::remote::Limit::MessageSize))
    );
    assert_eq!(
        id.state(),
        rcm::State::AddrBound,
        "the channel still answers"
    );
}

#[test]
fn map_channel_is_only_for_an_attached_channel() {
    let d = daemon("shm-where", 49303, &[1]);
    let (mut s, token) = raw(&d);
    // On the session's own connection: refused, and the session goes on.
    let (m, region) = s.map_channel().expect("answer");
    assert!(matches!(m, Message::Err(_)), "{m:?}");
    assert!(region.is_none());
    let _ = stats(&mut s);
    // Twice on one channel: the second comes through the ring and is refused there.
    let (mut c, mut tx, mut rx) = mapped_rings(&d, token);
    let m = ring_call(&mut tx, &mut rx, &mut c, &Command::MapChannel, 9);
    assert!(matches!(m, Message::Err(_)), "{m:?}");
    // GET_EVENT grants nothing on a mapped channel, as on any channel.
    let m = ring_call(&mut tx, &mut rx, &mut c, &Command::GetEvent(5), 11);
    assert!(
        matches!(m, Message::Err(proto::WireError::BadMessage(_))),
        "{m:?}"
    );
    let m = ring_call(&mut tx, &mut rx, &mut c, &Command::Stats, 10);
    assert!(
        matches!(m, Message::Ok(Answer::Stats(ref st)) if st.credit == 0),
        "{m:?}"
    );
}

#[test]
fn garbage_in_a_mapped_ring_ends_that_channel_only() {
    let d = daemon("shm-garbage", 49304, &[1]);
    let (mut s, token) = raw(&d);
    for (what, spoil) in [
        ("an index out of range", 0usize),
        ("a frame that lies about its length", 1),
        ("a frame longer than what was published", 2),
    ] {
        let (mut c, region) = mapped(&d, token);
        let mut tx = Producer::new(region.clone(), COMMANDS).expect("producer");
        let mut rx = Consumer::new(region.clone(), ANSWERS).expect("consumer");
        // It works first.
        let m = ring_call(&mut tx, &mut rx, &mut c, &Command::Devices, 1);
        assert!(matches!(m, Message::Ok(Answer::Devices(_))), "{m:?}");
        match spoil {
            0 => region
                .u32_at(COMMANDS.ctl)
                .store(0xDEAD_BEEF, Ordering::SeqCst),
            1 => {
                let mut f = Command::Devices.encode(2);
                f.extend_from_slice(&[0; 8]);
                tx.push(&f).expect("push");
            }
            _ => {
                // A length of 1,000 with only 8 bytes published.
                let tail = region.u32_at(COMMANDS.ctl).load(Ordering::SeqCst);
                let at = COMMANDS.data + (tail % COMMANDS.cap) as usize;
                for (i, b) in [0xE8u8, 0x03, 0, 0, 1, 2, 3, 4].iter().enumerate() {
                    region.bytes(at + i, 1)[0].store(*b, Ordering::SeqCst);
                }
                region
                    .u32_at(COMMANDS.ctl)
                    .store(tail.wrapping_add(8), Ordering::SeqCst);
            }
        }
        c.send_bytes(&[1]).expect("doorbell");
        assert!(c.closed_by_daemon(), "{what}: the channel was kept");
        // The session and the daemon go on.
        let _ = stats(&mut s);
    }
    round_trip(&d, sa(1, 7305));
}

/// Random writes into mapped rings (valid and mutated commands, random control words and
/// bytes, doorbells, hang-ups), for a bounded time: the daemon's threads never panic and a
/// well-behaved client is served afterwards. `RCM_UCM_FUZZ_SECS` sets the time (1 s).
#[test]
fn fuzzed_rings_leave_the_daemon_serving() {
    let secs = std::env::var("RCM_UCM_FUZZ_SECS")
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(1.0);
    let panics = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let p = panics.clone();
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("rcm-"))
        {
            p.fetch_add(1, Ordering::SeqCst);
        }
        prev(info);
    }));
    let d = daemon("shm-fuzz", 49305, &[1]);
    let (mut s, token) = raw(&d);
    let fds_before = open_fds();
    let mut rng = StdRng::seed_from_u64(0x5EED_5A3D);
    let until = Instant::now() + Duration::from_secs_f64(secs);
    let (mut channels, mut frames, mut answers) = (0u32, 0u32, 0u32);
    // At least 300 channels whatever the time, so that a descriptor leaked per channel
    // stands out from the slack below.
    while Instant::now() < until || channels < 300 {
        // The daemon lets a hung-up channel go when its ring thread next looks (at once when
        // it sleeps, within 10 ms while it polls): until then the channel counts against
        // the session's limit.
        wait_until(
            || d.channels() < rcm_ucm::MAX_CHANNELS,
            || format!("{} channels still open", d.channels()),
        );
        let (mut c, region) = mapped(&d, token);
        channels += 1;
        let mut tx = Producer::new(region.clone(), COMMANDS).expect("producer");
        let mut rx = Consumer::new(region.clone(), ANSWERS).expect("consumer");
        let mut f = Vec::new();
        for _ in 0..rng.gen_range(1..40) {
            match rng.gen_range(0..10) {
                0..=4 => {
                    let cmd = match rng.gen_range(0..6) {
                        0 => Command::CreateId(rcm::PortSpace::Tcp),
                        1 => Command::DestroyId(rng.gen_range(0..8)),
                        2 => Command::Devices,
                        3 => Command::Stats,
                        4 => Command::GetEvent(rng.gen()),
                        _ => Command::Call(rng.gen_range(0..8), rcm::remote::Op::Query),
                    };
                    let mut b = cmd.encode(rng.gen());
                    if rng.gen_bool(0.3) {
                        let i = rng.gen_range(0..b.len());
                        b[i] = rng.gen();
                    }
                    let _ = tx.push(&b);
                    frames += 1;
                }
                5 => {
                    let w = rng.gen_range(0..3) * 64;
                    region
                        .u32_at(COMMANDS.ctl + w)
                        .store(rng.gen(), Ordering::SeqCst);
                }
                6 => {
                    let at = rng.gen_range(0..COMMANDS.cap as usize);
                    region.bytes(COMMANDS.data + at, 1)[0].store(rng.gen(), Ordering::SeqCst);
                }
                7 => {
                    let n = rng.gen_range(0..64);
                    let junk: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
                    let _ = tx.push(&junk);
                }
                8 => {
                    let _ = c.send_bytes(&[rng.gen()]);
                }
                _ => {
                    while let Ok(true) = rx.pop(&mut f, 1 << 20) {
                        answers += 1;
                    }
                }
            }
        }
        let _ = c.send_bytes(&[1]);
        drop(c);
    }
    assert!(
        channels > 200 && frames > 0,
        "the fuzzer did little: {channels} channels"
    );
    eprintln!("{channels} mapped channels, {frames} frames written, {answers} answers read");
    // The daemon still serves: this session, and two fresh clients through a connection.
    let _ = stats(&mut s);
    round_trip(&d, sa(1, 7306));
    assert_eq!(panics.load(Ordering::SeqCst), 0, "a daemon thread panicked");
    // Every channel's socket and memory is let go (the daemon runs in this process): a
    // leaked memfd per channel would show here (thousands of channels; the slack is for the
    // other tests of this binary running meanwhile).
    wait_until(
        || open_fds() <= fds_before + 100,
        || format!("{} descriptors open, {fds_before} before", open_fds()),
    );
}

/// Descriptors this process has open.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, Iterator::count)
}

#[test]
fn a_call_waiting_on_a_mapped_channel_fails_when_the_daemon_goes() {
    let d = daemon("shm-gone", 49306, &[1]);
    let (client, _f, ch, id) = bound(&d, 7307);
    assert!(client.mapped_channels() >= 1);
    d.shutdown();
    // The channel's socket is the lifeline: the call fails instead of waiting on the ring.
    let t0 = Instant::now();
    let r = id.resolve_addr(None, sa(1, 9));
    assert!(
        matches!(
            r,
            Err(rcm::Error::DeviceRemoved | rcm::Error::InvalidState(rcm::State::DeviceRemoval))
        ),
        "{r:?}"
    );
    assert!(t0.elapsed() < T, "the call waited");
    let e = next(&ch);
    assert!(matches!(e.event(), rcm::Event::DeviceRemoval), "{e:?}");
}

/// A client whose answer ring sleeps is woken by the daemon's doorbell: one byte on the
/// channel's socket, written only because the ring says the client sleeps.
#[test]
fn a_sleeping_client_is_woken_by_the_daemons_doorbell() {
    let d = daemon("shm-bell", 49308, &[1]);
    let (_s, token) = raw(&d);
    let (mut c, mut tx, mut rx) = mapped_rings(&d, token);
    for seq in 1..=3 {
        assert!(rx.prepare_sleep(), "no answer is due");
        if tx
            .push(&Command::Devices.encode(seq))
            .expect("push")
            .expect("room")
        {
            c.send_bytes(&[1]).expect("the daemon's doorbell");
        }
        wait_doorbell(c.stream(), &format!("round {seq}"));
        rx.awake();
        let mut f = Vec::new();
        assert!(
            rx.pop(&mut f, 1 << 20).expect("pop"),
            "round {seq}: woken for nothing"
        );
        let h = Header::parse(f.first_chunk::<12>().expect("a header")).expect("header");
        assert_eq!(h.seq, seq);
        let m = proto::decode_message(h.kind, &f[12..]).expect("an answer");
        assert!(matches!(m, Message::Ok(Answer::Devices(_))), "{m:?}");
        // The daemon's side goes to sleep too before the next round (its spin is 100 µs).
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A client that sends commands without reading their answers fills its answer ring: its
/// channel then waits, and every other client is served as before. Once it reads, it gets
/// every answer, in order.
#[test]
fn a_client_that_does_not_read_its_answers_holds_up_no_one_else() {
    let d = daemon("shm-unread", 49309, &[1]);
    let (_s, token) = raw(&d);
    let (mut c, mut tx, mut rx) = mapped_rings(&d, token);
    // Each answer takes 32 bytes of the 64 KiB ring (a header word, then its 20 bytes in
    // whole words): 2,500 of them do not fit (checked below); the commands (24 bytes each) do.
    let n = 2500u32;
    push_unanswered(&mut tx, &mut c, n);
    wait_until(|| rx.has_data(), || "no answer came".into());
    // Others are served meanwhile, on channels of the same ring thread.
    round_trip(&d, sa(1, 7309));
    let mut f = Vec::new();
    let mut seq = 0;
    let end = Instant::now() + T;
    while seq < n {
        if rx.pop(&mut f, 1 << 20).expect("pop") {
            seq += 1;
            let h = Header::parse(f.first_chunk::<12>().expect("a header")).expect("header");
            assert_eq!(h.seq, seq, "answers out of order");
        } else {
            assert!(Instant::now() < end, "{seq} of {n} answers came");
            std::thread::yield_now();
        }
    }
    assert!(
        n as usize * Producer::footprint(f.len()) > rcm_ucm::shmchan::RING_BYTES as usize,
        "the answers ({} bytes each) would all have fit in the ring",
        f.len()
    );
    // The channel goes on as usual.
    let m = ring_call(&mut tx, &mut rx, &mut c, &Command::Devices, n + 1);
    assert!(matches!(m, Message::Ok(Answer::Devices(_))), "{m:?}");
}

/// With several ring threads, channels of several sessions are spread over them and every
/// one is served; a channel whose client hangs up is let go while the others keep going.
#[test]
fn several_ring_threads_serve_every_channel() {
    let mut cfg = config("shm-threads", 49310, &[1]);
    cfg.ring_threads = 3;
    let d = Daemon::start(cfg).expect("daemon");
    let (_s, token) = raw(&d);
    let mut chans: Vec<_> = (0..7).map(|_| mapped_rings(&d, token)).collect();
    let before = d.channels();
    std::thread::scope(|s| {
        for (k, (c, tx, rx)) in chans.iter_mut().enumerate() {
            s.spawn(move || {
                for seq in 1..=200 {
                    let m = ring_call(tx, rx, c, &Command::Devices, seq);
                    assert!(
                        matches!(m, Message::Ok(Answer::Devices(_))),
                        "channel {k}: {m:?}"
                    );
                }
            });
        }
        s.spawn(|| round_trip(&d, sa(1, 7310)));
    });
    let (c, _, _) = chans.pop().expect("a channel");
    drop(c);
    wait_until(
        || d.channels() < before,
        || format!("{} channels, {before} before the hang-up", d.channels()),
    );
    for (k, (c, tx, rx)) in chans.iter_mut().enumerate() {
        let m = ring_call(tx, rx, c, &Command::Devices, 1000);
        assert!(
            matches!(m, Message::Ok(Answer::Devices(_))),
            "channel {k}: {m:?}"
        );
    }
}

/// A ring thread with no command to serve receives for the daemon's devices while it polls
/// its rings (their own threads stand aside): the datagrams of a connection between two
/// clients reach the engine through it, and the connection is made as before.
#[test]
fn a_ring_thread_with_nothing_to_serve_receives_for_the_devices() {
    let mut cfg = config("shm-devpoll", 49311, &[1]);
    // Through the device's socket, not handed to its engine directly, so that there is
    // something to receive; and polling long enough to be polling when each comes.
    cfg.fabric.loopback = false;
    cfg.fabric.spin = Duration::from_millis(200);
    let d = Daemon::start(cfg).expect("daemon");
    let dev = d.fabric().device(ip(1)).expect("the daemon's device");
    round_trip(&d, sa(1, 7311));
    let (rx, _) = dev.traffic();
    let polled = dev.busy_polled();
    assert!(
        rx >= 5,
        "{rx} datagrams received: the connection went elsewhere"
    );
    assert!(
        polled > 0,
        "none of the {rx} datagrams was received by the ring thread"
    );
}

/// Between the two devices of a two-address daemon, what the ring thread's commands send to
/// the other device is received by the ring thread too (it receives from every device right
/// after a round with work, see `ring_loop`): the REQ on the listener's device, the REP on
/// the client's; and the connection is made as before. A device's own thread may still take
/// a datagram first when the ring thread is slow (under valgrind, or a loaded CI host), so
/// the connection is made again, up to 20 times, until each device has had one taken by the
/// ring thread (a ring thread that never received for its devices would fail all 20).
#[test]
fn a_ring_thread_receives_what_its_commands_sent_to_its_other_device() {
    let mut cfg = config("shm-devsweep", 49312, &[1, 2]);
    cfg.fabric.spin = Duration::from_millis(200);
    let d = Daemon::start(cfg).expect("daemon");
    let devs = [ip(1), ip(2)].map(|a| d.fabric().device(a).expect("the daemon's device"));
    for _ in 0..20 {
        round_trip(&d, sa(2, 7312));
        if devs.iter().all(|dev| dev.busy_polled() > 0) {
            break;
        }
    }
    for (k, dev) in devs.iter().enumerate() {
        let (rx, _) = dev.traffic();
        let polled = dev.busy_polled();
        assert!(rx >= 2, "device {k}: {rx} datagrams received");
        assert!(
            polled > 0,
            "device {k}: none of its {rx} datagrams was received by the ring thread"
        );
    }
}

/// A client that writes without pause on its mapped channel's socket (where a doorbell is one
/// byte) must not hold the daemon's ring thread: the thread drained such a socket until it
/// was empty, so other clients' mapped channels served by it got no answer and the daemon's
/// shutdown, which joins that thread, never finished while the flood went on.
#[test]
fn a_client_flooding_its_doorbell_holds_up_no_one_else_nor_the_shutdown() {
    let mut cfg = config("shm-bell-flood", 49313, &[1]);
    cfg.ring_threads = 1;
    let d = Daemon::start(cfg).expect("daemon");
    let (_victim, victim_token) = raw(&d);
    let (mut vbell, mut vtx, mut vrx) = mapped_rings(&d, victim_token);
    let answered = |tx: &mut Producer, rx: &mut Consumer, bell: &mut _, seq| {
        ring_call_within(tx, rx, bell, &Command::Devices, seq, T).is_some()
    };
    assert!(
        answered(&mut vtx, &mut vrx, &mut vbell, 1),
        "before the flood"
    );
    // Three other clients' mapped channels, their sockets written to without pause (with a
    // large send buffer where allowed, root only, so the socket is never found empty).
    let stop = Arc::new(AtomicBool::new(false));
    let mut held = Vec::new();
    let mut flooders = Vec::new();
    for _ in 0..3 {
        let (s, token) = raw(&d);
        let (bell, tx, rx) = mapped_rings(&d, token);
        let stream = bell.stream().try_clone().expect("clone");
        let _ = rustix::net::sockopt::set_socket_send_buffer_size_force(&stream, 8 << 20);
        let stop = stop.clone();
        flooders.push(std::thread::spawn(move || {
            use std::io::Write;
            let buf = vec![1u8; 256 * 1024];
            let mut w = &stream;
            while !stop.load(Ordering::Relaxed) && w.write_all(&buf).is_ok() {}
        }));
        held.push((s, bell, tx, rx));
    }
    std::thread::sleep(Duration::from_millis(200));
    let unanswered = (2..=41).find(|&k| !answered(&mut vtx, &mut vrx, &mut vbell, k));
    // The shutdown, with the flood still on.
    let (done_tx, done) = std::sync::mpsc::channel();
    let stopper = std::thread::spawn(move || {
        d.shutdown();
        let _ = done_tx.send(());
    });
    let stopped = done.recv_timeout(T).is_ok();
    stop.store(true, Ordering::Relaxed);
    for (_, bell, _, _) in &held {
        let _ = bell.stream().shutdown(std::net::Shutdown::Both);
    }
    for f in flooders {
        let _ = f.join();
    }
    let _ = stopper.join();
    assert_eq!(
        unanswered, None,
        "another client's doorbell flood kept the ring thread from answering this call"
    );
    assert!(
        stopped,
        "the daemon's shutdown did not finish during the flood"
    );
}

/// A daemon and a client whose threads poll long before they sleep (`FabricConfig::spin`,
/// five minutes here) both shut down without waiting the polls out: the client's session
/// reader (which runs its callbacks), its callback threads, the daemon's ring thread and its
/// devices' threads each end a poll when told to stop.
#[test]
fn long_polls_hold_up_no_shutdown() {
    let long = Duration::from_secs(300);
    let mut cfg = config("shm-long-polls", 49314, &[1]);
    cfg.fabric.spin = long;
    let d = Daemon::start(cfg).expect("daemon");
    let f = rcm_ucm::fabric_with(
        d.socket(),
        rcm::FabricConfig {
            spin: long,
            callbacks: rcm::CallbackMode::Inline,
            ..rcm::FabricConfig::default()
        },
    )
    .expect("session");
    // A call answered and a callback run, so that the threads have worked and now poll.
    let (tx, got) = std::sync::mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let id = f.create_id(rcm::PortSpace::Tcp, move |_, ev| {
        let _ = tx
            .lock()
            .unwrap()
            .send(matches!(ev, rcm::Event::AddrResolved));
        rcm::Flow::Continue
    });
    id.resolve_addr(None, sa(1, 7314)).expect("resolve_addr");
    assert_eq!(got.recv_timeout(T), Ok(true));
    within_a_minute(move || f.shutdown());
    within_a_minute(move || d.shutdown());
}
