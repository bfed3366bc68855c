//! Helpers shared by rcm-ucm's integration tests: daemons on loopback with
//! a UDP port of their own, raw-session shorthands, rcm-API dialing and leak checks.
#![allow(dead_code)]

use rcm::remote::Op;
use rcm::{AcceptOptions, ConnectOptions, Event, EventChannel, Fabric, FabricConfig, PortSpace};
use rcm_proto::ib::RetryPolicy;
use rcm_ucm::proto::{Answer, Command, Limits, Message, SessionStats, WireError};
use rcm_ucm::raw::RawSession;
use rcm_ucm::{Daemon, DaemonConfig};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How long any single wait in these tests may take.
pub const T: Duration = Duration::from_secs(10);

/// A socket path of this process and test.
pub fn sock(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("rcm-ucm-t-{}-{name}.sock", std::process::id()))
}

/// 127.0.0.`last`.
pub fn ip(last: u8) -> IpAddr {
    IpAddr::from([127, 0, 0, last])
}

/// 127.0.0.`last`:`port`.
pub fn sa(last: u8, port: u16) -> SocketAddr {
    SocketAddr::new(ip(last), port)
}

/// A destination off this host (198.18.0.0/15, the test range) that the daemon's loopback
/// devices cannot reach: `resolve_addr` to it, from an idle or a bound id, queues one
/// `AddrError` and sends nothing.
pub fn nowhere() -> SocketAddr {
    "198.18.0.1:1".parse().expect("address")
}

/// A daemon configuration on 127.0.0.`binds` with UDP port `port` and short CM retries.
pub fn config(name: &str, port: u16, binds: &[u8]) -> DaemonConfig {
    let mut cfg = DaemonConfig::new(sock(name), binds.iter().map(|b| ip(*b)).collect());
    cfg.fabric = FabricConfig {
        udp_port: port,
        retry: RetryPolicy::Backoff {
            initial: Duration::from_millis(50),
            max_wait: Duration::from_millis(200),
            deadline: Duration::from_secs(1),
        },
        dispatcher_threads: 4,
        // As the daemon runs by default (DaemonConfig::new): callbacks on device threads.
        callbacks: rcm::CallbackMode::Inline,
        ..FabricConfig::default()
    };
    cfg
}

/// Like [`config`], with retries slow enough (first after 2 s, give up after 20 s) that a
/// REQ nobody answers never times out within a test.
pub fn config_patient(name: &str, port: u16, binds: &[u8]) -> DaemonConfig {
    let mut cfg = config(name, port, binds);
    cfg.fabric.retry = RetryPolicy::Backoff {
        initial: Duration::from_secs(2),
        max_wait: Duration::from_secs(5),
        deadline: Duration::from_secs(20),
    };
    cfg
}

/// A started daemon (see [`config`]).
pub fn daemon(name: &str, port: u16, binds: &[u8]) -> Daemon {
    Daemon::start(config(name, port, binds)).expect("daemon starts")
}

/// A started daemon with these limits.
pub fn daemon_with_limits(name: &str, port: u16, binds: &[u8], limits: Limits) -> Daemon {
    let mut cfg = config(name, port, binds);
    cfg.limits = limits;
    Daemon::start(cfg).expect("daemon starts")
}

/// Polls `f` every 10 ms until it holds; panics with `what()` after `T`.
pub fn wait_until(mut f: impl FnMut() -> bool, what: impl Fn() -> String) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < T, "timed out waiting: {}", what());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until the daemon holds exactly `held` ids for its sessions and its fabric has
/// exactly `live` live ids.
pub fn wait_ids(d: &Daemon, held: usize, live: usize) {
    wait_until(
        || d.held_ids() == held && d.fabric().live_ids() == live,
        || {
            format!(
                "daemon holds {} ids (want {held}), fabric has {} live (want {live})",
                d.held_ids(),
                d.fabric().live_ids()
            )
        },
    );
}

/// The next channel event within `T`.
pub fn next(ch: &EventChannel) -> rcm::ChannelEvent {
    ch.get_event(Some(T)).expect("an event within 10 s")
}

/// A listener bound to `addr` with its channel.
pub fn listen(f: &Fabric, addr: SocketAddr) -> (rcm::CmId, EventChannel) {
    let ch = EventChannel::new();
    let l = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
    l.bind(addr).expect("bind");
    l.listen(16).expect("listen");
    (l, ch)
}

/// Active side up to a sent REQ.
pub fn dial(f: &Fabric, ch: &EventChannel, dst: SocketAddr, pd: &[u8]) -> rcm::CmId {
    let c = f.try_create_id_on(PortSpace::Tcp, ch).expect("create");
    c.resolve_addr(None, dst).expect("resolve_addr");
    let ev = next(ch);
    assert!(matches!(ev.event(), Event::AddrResolved), "{ev:?}");
    drop(ev);
    c.resolve_route().expect("resolve_route");
    let ev = next(ch);
    assert!(matches!(ev.event(), Event::RouteResolved), "{ev:?}");
    drop(ev);
    c.connect(&ConnectOptions {
        private_data: pd.to_vec(),
        ..ConnectOptions::default()
    })
    .expect("connect");
    c
}

/// Accepts the next connect request on `lch`; returns the child id.
pub fn accept_next(lch: &EventChannel, pd: &[u8]) -> rcm::CmId {
    let req = next(lch);
    assert!(
        matches!(req.event(), Event::ConnectRequest { .. }),
        "expected a connect request, got {req:?}"
    );
    let child = req.id().clone();
    drop(req);
    child
        .accept(&AcceptOptions {
            private_data: pd.to_vec(),
            ..AcceptOptions::default()
        })
        .expect("accept");
    child
}

/// The active side's ConnectResponse, then its RTU (`establish`).
pub fn establish_on_response(c: &rcm::CmId, cch: &EventChannel) {
    let rep = next(cch);
    assert!(
        matches!(rep.event(), Event::ConnectResponse { .. }),
        "expected ConnectResponse, got {rep:?}"
    );
    drop(rep);
    c.establish().expect("establish");
}

/// The active side's ConnectResponse then RTU, and both sides' Established.
pub fn finish_connect(c: &rcm::CmId, cch: &EventChannel, sch: &EventChannel) {
    establish_on_response(c, cch);
    let e = next(sch);
    assert!(matches!(e.event(), Event::Established { .. }), "{e:?}");
    drop(e);
    let e = next(cch);
    assert!(matches!(e.event(), Event::Established { .. }), "{e:?}");
}

/// A full connect / accept / private data / disconnect / destroy round trip between two new
/// client sessions of the daemon at `d`, through a listener at `addr`.
pub fn round_trip(d: &Daemon, addr: SocketAddr) {
    let server = rcm_ucm::fabric(d.socket()).expect("server session");
    let client = rcm_ucm::fabric(d.socket()).expect("client session");
    let (l, sch) = listen(&server, addr);
    let cch = EventChannel::new();
    let c = dial(&client, &cch, addr, b"round trip");
    let req = next(&sch);
    let child = req.id().clone();
    match req.event() {
        Event::ConnectRequest { private_data, .. } => {
            assert_eq!(&private_data[..10], b"round trip");
        }
        other => panic!("expected a connect request, got {other:?}"),
    }
    drop(req);
    child
        .accept(&AcceptOptions {
            private_data: b"back".to_vec(),
            ..AcceptOptions::default()
        })
        .expect("accept");
    let rep = next(&cch);
    match rep.event() {
        Event::ConnectResponse { private_data, .. } => assert_eq!(&private_data[..4], b"back"),
        other => panic!("expected ConnectResponse, got {other:?}"),
    }
    drop(rep);
    c.establish().expect("establish");
    let e = next(&sch);
    assert!(matches!(e.event(), Event::Established { .. }), "{e:?}");
    drop(e);
    let e = next(&cch);
    assert!(matches!(e.event(), Event::Established { .. }), "{e:?}");
    drop(e);
    c.disconnect().expect("disconnect");
    let e = next(&cch);
    assert!(matches!(e.event(), Event::Disconnected), "{e:?}");
    drop(e);
    let e = next(&sch);
    assert!(matches!(e.event(), Event::Disconnected), "{e:?}");
    drop(e);
    for id in [c, child, l] {
        assert_eq!(id.destroy(), Ok(rcm::DestroyOutcome::Done));
    }
    server.shutdown();
    client.shutdown();
}

// ---------------------------------------------------------------------------------------
// Raw sessions

/// A raw session that said Hello; with its token.
pub fn raw(d: &Daemon) -> (RawSession, u64) {
    let (s, token) = RawSession::open(d.socket()).expect("raw session");
    s.set_timeout(T).expect("timeout");
    (s, token)
}

/// `CreateId(Tcp)`; the handle.
pub fn create(s: &mut RawSession) -> u32 {
    match s.call(&Command::CreateId(PortSpace::Tcp)).expect("reply") {
        Message::Ok(Answer::Handle(h)) => h,
        m => panic!("CreateId answered {m:?}"),
    }
}

/// A new id of `s` bound to `addr` and listening with `backlog`: its handle.
pub fn raw_listener(s: &mut RawSession, addr: SocketAddr, backlog: usize) -> u32 {
    let h = create(s);
    ok(s, &Command::Call(h, Op::Bind(addr)));
    ok(s, &Command::Call(h, Op::Listen(backlog)));
    h
}

/// A command that must succeed; its answer.
pub fn ok(s: &mut RawSession, cmd: &Command) -> Answer {
    match s.call(cmd).expect("reply") {
        Message::Ok(a) => a,
        m => panic!("{cmd:?} answered {m:?}"),
    }
}

/// A command that must fail; its error.
pub fn err(s: &mut RawSession, cmd: &Command) -> WireError {
    match s.call(cmd).expect("reply") {
        Message::Err(e) => e,
        m => panic!("{cmd:?} answered {m:?}, expected an error"),
    }
}

/// The session's counters.
pub fn stats(s: &mut RawSession) -> SessionStats {
    match ok(s, &Command::Stats) {
        Answer::Stats(st) => st,
        a => panic!("Stats answered {a:?}"),
    }
}

/// Polls the session's counters until `f` holds.
pub fn wait_stats(s: &mut RawSession, f: impl Fn(&SessionStats) -> bool, what: &str) {
    let t0 = Instant::now();
    loop {
        let st = stats(s);
        if f(&st) {
            return;
        }
        assert!(t0.elapsed() < T, "timed out waiting for {what}: {st:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Asserts no message arrives within `d`.
pub fn assert_silent(s: &mut RawSession, d: Duration) {
    s.set_timeout(d).expect("timeout");
    match s.recv() {
        Ok(m) => panic!("unexpected message {m:?}"),
        Err(e) => assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "read failed: {e}"
        ),
    }
    s.set_timeout(T).expect("timeout");
}

/// `Attach` to the session holding `token`, at this protocol version.
pub fn attach_cmd(token: u64) -> Command {
    Command::Attach {
        min: rcm_ucm::proto::VERSION,
        max: rcm_ucm::proto::VERSION,
        token,
    }
}

/// A command channel: a connection attached to the session holding `token`.
pub fn channel(d: &Daemon, token: u64) -> RawSession {
    let mut c = RawSession::connect(d.socket()).expect("connect");
    c.set_timeout(T).expect("timeout");
    assert_eq!(
        ok(&mut c, &attach_cmd(token)),
        Answer::Reply(rcm::remote::Reply::Done),
        "attach"
    );
    c
}

/// Reads one command from a client (as a fake daemon does), with its sequence number.
pub fn read_command(s: &mut std::os::unix::net::UnixStream) -> (u32, Command) {
    use std::io::Read;
    let mut hb = [0u8; 12];
    s.read_exact(&mut hb).expect("a command header");
    let h = rcm_ucm::proto::Header::parse(&hb).expect("a header");
    let mut body = vec![0u8; h.body_len()];
    s.read_exact(&mut body).expect("a command body");
    (
        h.seq,
        rcm_ucm::proto::decode_command(h.kind, &body).expect("a command"),
    )
}

/// Waits (up to `T`) for a doorbell on `s`, the socket of a mapped ring that was marked
/// asleep, and reads it; `what` names the wait in a failure.
pub fn wait_doorbell(s: &std::os::unix::net::UnixStream, what: &str) {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(s, PollFlags::IN)];
    let t = Timespec::try_from(T).expect("timeout");
    let n = poll(&mut fds, Some(&t)).expect("poll");
    assert_eq!(n, 1, "{what}: no doorbell from the daemon");
    let mut b = [0u8; 8];
    let got = rustix::net::recv(s, &mut b, rustix::net::RecvFlags::DONTWAIT)
        .expect("the doorbell's byte");
    assert!(got.0 >= 1, "{what}: the daemon hung up");
}

/// The next frame in a ring a test reads as the client (waiting up to `T`), decoded, with
/// its sequence number; the frame must be as long as its header says.
pub fn next_frame(rx: &mut rcm_shm::Consumer) -> (u32, Message) {
    next_frame_within(rx, T).expect("nothing came in the ring")
}

/// The next frame in a mapped ring if one comes within `wait`: its seq and message.
pub fn next_frame_within(rx: &mut rcm_shm::Consumer, wait: Duration) -> Option<(u32, Message)> {
    let end = Instant::now() + wait;
    let mut f = Vec::new();
    while !rx.pop(&mut f, 1 << 20).expect("pop") {
        if Instant::now() >= end {
            return None;
        }
        std::thread::yield_now();
    }
    let h =
        rcm_ucm::proto::Header::parse(f.first_chunk::<12>().expect("a header")).expect("header");
    assert_eq!(
        f.len(),
        4 + h.len as usize,
        "a frame of its header's length"
    );
    Some((
        h.seq,
        rcm_ucm::proto::decode_message(h.kind, &f[12..]).expect("a message"),
    ))
}

/// A fake daemon's side of a session's opening: `HELLO` answered (token 7), `MAP_EVENTS`
/// answered by `map` (given the socket and the command's seq), the first credit read.
pub fn open_fake_session<R>(
    s: &mut std::os::unix::net::UnixStream,
    map: impl FnOnce(&mut std::os::unix::net::UnixStream, u32) -> R,
) -> R {
    use std::io::Write;
    let (seq, hello) = read_command(s);
    assert!(matches!(hello, Command::Hello { .. }), "{hello:?}");
    let ok = Message::HelloOk {
        version: rcm_ucm::proto::VERSION,
        token: 7,
        limits: Limits::default(),
    };
    s.write_all(&ok.encode(seq)).expect("hello ok");
    let (seq, cmd) = read_command(s);
    assert_eq!(cmd, Command::MapEvents);
    let r = map(s, seq);
    let (_, credit) = read_command(s);
    assert!(matches!(credit, Command::GetEvent(_)), "{credit:?}");
    r
}

/// A fake daemon refusing every command channel that connects to `listener` (so that the
/// client's calls come on its session's connection), until the listener fails.
pub fn refuse_channels(listener: &std::os::unix::net::UnixListener) {
    use std::io::Write;
    for c in listener.incoming() {
        let Ok(mut c) = c else { return };
        let (seq, _) = read_command(&mut c);
        let no = Message::Err(WireError::Cm(rcm::Error::LimitExceeded(
            rcm::remote::Limit::Channels,
        )));
        let _ = c.write_all(&no.encode(seq));
    }
}

/// Writes `frame` with `fd` attached (`SCM_RIGHTS`), as the daemon sends its memory.
pub fn send_with_fd(s: &std::os::unix::net::UnixStream, frame: &[u8], fd: &std::os::fd::OwnedFd) {
    use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    use std::io::Write;
    use std::os::fd::AsFd;
    let fds = [fd.as_fd()];
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
    let n = sendmsg(
        s,
        &[std::io::IoSlice::new(frame)],
        &mut control,
        SendFlags::NOSIGNAL,
    )
    .expect("sendmsg");
    let mut w = s;
    w.write_all(&frame[n..]).expect("the rest");
}

/// Whether the client marked its events ring asleep (its reader about to sleep on the
/// socket, so that the daemon rings the doorbell): the consumer's flag, 128 bytes past the
/// ring's control block (§2.3 of `docs/ucm-protocol.md`).
pub fn events_ring_asleep(region: &rcm_shm::Region) -> bool {
    region
        .u32_at(rcm_ucm::shmchan::EVENTS.ctl + 128)
        .load(std::sync::atomic::Ordering::SeqCst)
        != 0
}

/// `f`'s result; fails the test if it takes over a minute (a deadlock would hang it, and the
/// threads it hangs with, for good).
pub fn within_a_minute<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(Ok(r)) => r,
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("still running after a minute: deadlocked")
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => unreachable!("sent before"),
    }
}

/// Pushes `DEVICES` commands 1..=`n` into a mapped channel's commands ring `tx`, ringing its
/// doorbell `c` whenever the daemon sleeps, without reading any answer: 2,500 answers (32
/// bytes each) overflow the 64 KiB answer ring, while their commands (24 bytes each) fit in
/// theirs.
pub fn push_unanswered(tx: &mut rcm_shm::Producer, c: &mut RawSession, n: u32) {
    for seq in 1..=n {
        if tx
            .push(&Command::Devices.encode(seq))
            .expect("push")
            .expect("the commands fit")
        {
            c.send_bytes(&[1]).expect("doorbell");
        }
    }
}
