//! The client library against a daemon that answers badly, and a client dropped without a
//! fabric: a call answered by a frame that does not decode fails instead of waiting for
//! ever, an undecodable event still gives its credit back, and a dropped `Client` ends its
//! session.

mod common;

use common::*;
use rcm_ucm::proto::{self, Command, Message, WireError};
use rcm_ucm::Client;
use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The handle of a client's first id: the client library chooses its ids' handles.
const FIRST: u32 = proto::CLIENT_HANDLES;

/// A frame as the daemon writes it.
fn frame(kind: u16, seq: u32, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(12 + body.len());
    f.extend_from_slice(&(8 + body.len() as u32).to_le_bytes());
    f.extend_from_slice(&kind.to_le_bytes());
    f.extend_from_slice(&0u16.to_le_bytes());
    f.extend_from_slice(&seq.to_le_bytes());
    f.extend_from_slice(body);
    f
}

/// The next command a client sent.
/// The daemon's side of a session's opening: `HELLO` answered, `MAP_EVENTS` declined (so
/// the session's frames, which these fake daemons write, go on the socket), the first
/// credit read.
fn open_session(s: &mut UnixStream) {
    open_fake_session(s, |s, seq| {
        let no = WireError::BadMessage("not here".into());
        s.write_all(&Message::Err(no).encode(seq)).expect("refusal");
    });
}

/// A fake daemon at a fresh socket path: it opens one session (the handshake and the
/// client's first event credit) and refuses every command channel, so the client makes its
/// calls on the session's connection. Returns the path and the session's server end.
fn fake_daemon(name: &str) -> (std::path::PathBuf, mpsc::Receiver<UnixStream>) {
    let (path, listener) = fake_listener(name);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let Ok((mut s, _)) = listener.accept() else {
            return;
        };
        open_session(&mut s);
        let _ = tx.send(s);
        refuse_channels(&listener);
    });
    (path, rx)
}

/// A fake daemon's session with a client and a fabric on it: the socket path, the client,
/// the fabric and the session's server end (reads time out after `T`).
fn fake_session(name: &str) -> (std::path::PathBuf, Client, rcm::Fabric, UnixStream) {
    let (path, session) = fake_daemon(name);
    let client = Client::connect(&path).expect("session");
    let f = rcm::Fabric::with_provider(
        std::sync::Arc::new(client.clone()),
        rcm::FabricConfig::default(),
    );
    let s = session.recv_timeout(T).expect("the session");
    s.set_read_timeout(Some(T)).expect("timeout");
    (path, client, f, s)
}

#[test]
fn a_call_answered_by_an_undecodable_frame_fails_instead_of_waiting() {
    let (path, session) = fake_daemon("bad-answer");
    let client = Client::connect(&path).expect("session");
    let mut s = session.recv_timeout(T).expect("the session");
    let (tx, done) = mpsc::channel();
    let c = client.clone();
    std::thread::spawn(move || {
        let _ = tx.send(c.stats());
    });
    let (seq, cmd) = read_command(&mut s);
    assert_eq!(cmd, Command::Stats);
    // An OK frame whose answer code means nothing.
    s.write_all(&frame(proto::kind::OK, seq, &[0xEE, 0xEE, 0xEE]))
        .expect("write");
    let r = done
        .recv_timeout(T)
        .expect("the call returned instead of waiting for ever");
    assert!(
        matches!(&r, Err(rcm::Error::Remote(m)) if m.contains("bad answer")),
        "{r:?}"
    );
    // The session goes on.
    assert!(client.is_alive());
    let _ = std::fs::remove_file(&path);
}

#[test]
fn undecodable_events_give_their_credit_back() {
    let (path, session) = fake_daemon("bad-events");
    let client = Client::connect(&path).expect("session");
    let mut s = session.recv_timeout(T).expect("the session");
    // A quarter of the client's window (4096) of events that do not decode: it must still
    // return their credit, or the daemon would stop sending events for good.
    let mut burst = Vec::new();
    for _ in 0..1024 {
        burst.extend_from_slice(&frame(proto::kind::EVENT, 0, &[0xEE]));
    }
    s.write_all(&burst).expect("write");
    s.set_read_timeout(Some(T)).expect("timeout");
    let (_, cmd) = read_command(&mut s);
    assert_eq!(cmd, Command::GetEvent(1024));
    assert!(client.is_alive());
    let _ = std::fs::remove_file(&path);
}

#[test]
fn dropping_a_client_ends_its_session() {
    let d = daemon("drop-client", 47220, &[1]);
    let client = Client::connect(d.socket()).expect("session");
    client.stats().expect("stats");
    assert_eq!(d.sessions(), 1);
    drop(client);
    let t0 = Instant::now();
    while d.sessions() != 0 {
        assert!(t0.elapsed() < T, "the session outlived its client");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A connect request whose child the listener's callback destroys at once (`Flow::Destroy`,
/// on a dispatcher thread, racing the reader that is still filing the child) leaves nothing
/// behind in the client: only the listener stays held.
#[test]
fn children_destroyed_by_their_first_callback_leave_nothing_held() {
    use rcm::{Event, Fabric, FabricConfig, Flow, PortSpace};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    const N: usize = 200;
    let d = daemon("child-release", 47221, &[1]);
    let session = Client::connect(d.socket()).expect("session");
    let server = Fabric::with_provider(Arc::new(session.clone()), FabricConfig::default());
    let seen = Arc::new(AtomicUsize::new(0));
    let s2 = seen.clone();
    let l = server
        .try_create_id(PortSpace::Tcp, move |_, ev| match ev {
            Event::ConnectRequest { .. } => {
                s2.fetch_add(1, Ordering::SeqCst);
                Flow::Destroy
            }
            _ => Flow::Continue,
        })
        .expect("listener");
    l.bind(sa(1, 7700)).expect("bind");
    l.listen(64).expect("listen");
    let client = rcm_ucm::fabric(d.socket()).expect("client");
    let (tx, rx) = mpsc::channel();
    for _ in 0..N {
        let tx = tx.clone();
        let c = client
            .try_create_id(PortSpace::Tcp, move |id, ev| {
                match ev {
                    Event::AddrResolved => {
                        let _ = id.resolve_route();
                    }
                    Event::RouteResolved => {
                        let _ = id.connect(&rcm::ConnectOptions::default());
                    }
                    Event::Rejected { .. } | Event::Unreachable(_) => {
                        let _ = tx.send(());
                        return Flow::Destroy;
                    }
                    _ => {}
                }
                Flow::Continue
            })
            .expect("client id");
        c.resolve_addr(None, sa(1, 7700)).expect("resolve");
    }
    for _ in 0..N {
        rx.recv_timeout(T).expect("every connect is rejected");
    }
    // At least one request per connect (a REQ retried before its REJ arrived, on a busy
    // machine, is a request again once the first child is gone).
    assert!(seen.load(Ordering::SeqCst) >= N);
    let t0 = Instant::now();
    while session.held_ids() != 1 {
        assert!(
            t0.elapsed() < T,
            "{} ids held besides the listener",
            session.held_ids() - 1
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(l.destroy(), Ok(rcm::DestroyOutcome::Done));
    assert_eq!(session.held_ids(), 0);
}

/// An error text longer than the 1,024 bytes a decoder accepts is cut when sent (on a
/// character boundary), so the error still decodes; before, the answer was undecodable
/// and the client reported "bad answer" instead of the error.
#[test]
fn a_long_error_text_is_cut_to_what_decodes() {
    let long = "é".repeat(700); // 1,400 bytes, two per character
    let frame = Message::Err(WireError::Cm(rcm::Error::Io(long.clone()))).encode(9);
    let (h, body) = proto::split_frame(&frame).expect("a frame");
    match proto::decode_message(h.kind, body).expect("it decodes") {
        Message::Err(WireError::Cm(rcm::Error::Io(text))) => {
            assert_eq!(text.len(), 1024);
            assert!(long.starts_with(&text));
        }
        m => panic!("{m:?}"),
    }
}

/// The client's reader never blocks writing to the daemon. Here the daemon (fake) stops
/// reading the session's connection while the client destroys 599 ids without a command
/// channel (fire-and-forget DESTROY_IDs, more than the socket holds) and then sends 3,000
/// events: the reader must take them all, giving credit back on the way. It used to write
/// that credit itself, behind the destroying thread blocked on the full socket, and stopped
/// reading at the first quarter window (1,024): with a real daemon blocked writing to the
/// client in turn, the whole session hung.
#[test]
fn the_reader_keeps_reading_while_the_daemon_reads_nothing() {
    // Run where a hang (the old behaviour: even the fabric's drop waited on the socket) is
    // a failure, not a stuck test.
    let (tx, done) = mpsc::channel();
    std::thread::spawn(move || {
        reader_keeps_reading();
        let _ = tx.send(());
    });
    match done.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => {}
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("the session hung"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the test body failed (above)"),
    }
}

fn reader_keeps_reading() {
    const IDS: u32 = 600;
    const EVENTS: usize = 3000;
    let (path, _client, f, mut s) = fake_session("reader-never-writes");
    let ch = rcm::EventChannel::new();
    let maker = {
        let (f, ch) = (f.clone(), ch.clone());
        std::thread::spawn(move || {
            (0..IDS)
                .map(|_| {
                    f.try_create_id_on(rcm::PortSpace::Tcp, &ch)
                        .expect("create")
                })
                .collect::<Vec<_>>()
        })
    };
    for h in FIRST..FIRST + IDS {
        let (seq, cmd) = read_command(&mut s);
        assert_eq!(cmd, Command::CreateIdAs(rcm::PortSpace::Tcp, h));
        let ok = Message::Ok(proto::Answer::Handle(h));
        s.write_all(&ok.encode(seq)).expect("reply");
    }
    let mut ids = maker.join().expect("maker");
    let kept = ids.remove(0);
    // From here the daemon reads nothing. The destroys fill the socket to the daemon.
    let destroyer = std::thread::spawn(move || {
        for id in ids {
            drop(id.begin_destroy());
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    let event = Message::Event {
        handle: FIRST,
        event: proto::WireEvent::AddrResolved,
        qp: None,
    }
    .encode(0);
    let writer = std::thread::spawn(move || {
        for _ in 0..EVENTS {
            if s.write_all(&event).is_err() {
                return;
            }
        }
        // Held open until the test is done reading.
        std::thread::sleep(Duration::from_secs(10));
    });
    for k in 0..EVENTS {
        let e = ch
            .get_event(Some(Duration::from_secs(5)))
            .unwrap_or_else(|| panic!("the reader stopped after {k} of {EVENTS} events"));
        assert_eq!(e.id(), &kept);
    }
    destroyer.join().expect("destroyer");
    drop(writer);
    let _ = std::fs::remove_file(&path);
}

/// The fake daemon's side of an inline-callback client's start: the session opened, one
/// command channel attached (inline callbacks need one), the client's `CreateId` answered
/// with handle 1 on it. Waits for `go` (an event for a handle the client has not filed yet
/// would be dropped) and returns the session, the channel and an ADDR_RESOLVED event for
/// handle 1, encoded.
fn session_channel_and_one_id(
    listener: &UnixListener,
    go: &mpsc::Receiver<()>,
) -> (UnixStream, UnixStream, Vec<u8>) {
    let (mut s, _) = listener.accept().expect("session");
    open_session(&mut s);
    let (mut c, _) = listener.accept().expect("channel");
    let (seq, attach) = read_command(&mut c);
    assert!(matches!(attach, Command::Attach { .. }), "{attach:?}");
    c.write_all(&Message::Ok(proto::Answer::Reply(rcm::remote::Reply::Done)).encode(seq))
        .expect("attach ok");
    refuse_map(&mut c);
    let (seq, create) = read_command(&mut c);
    assert_eq!(create, Command::CreateIdAs(rcm::PortSpace::Tcp, FIRST));
    c.write_all(&Message::Ok(proto::Answer::Handle(FIRST)).encode(seq))
        .expect("handle");
    go.recv_timeout(T).expect("the id is made");
    let event = Message::Event {
        handle: FIRST,
        event: proto::WireEvent::AddrResolved,
        qp: None,
    }
    .encode(0);
    (s, c, event)
}

/// The fake daemon's side of a channel's `MAP_CHANNEL` (the client asks right after
/// `ATTACH`): declined, so the channel's calls stay on its socket, where the fake daemon
/// reads them.
fn refuse_map(c: &mut UnixStream) {
    let (seq, map) = read_command(c);
    assert_eq!(map, Command::MapChannel);
    let no = WireError::BadMessage("not here".into());
    c.write_all(&Message::Err(no).encode(seq)).expect("refusal");
}

/// A fake daemon's listening socket at a fresh path named `name`.
fn fake_listener(name: &str) -> (std::path::PathBuf, UnixListener) {
    let path = sock(name);
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).expect("bind");
    (path, listener)
}

/// A fabric on a session of the daemon at `path` whose reader runs the callbacks of what
/// it receives (`CallbackMode::Inline`), polling for `spin` before it sleeps.
fn inline_fabric(path: &std::path::Path, spin: Duration) -> rcm::Fabric {
    let cfg = rcm::FabricConfig {
        callbacks: rcm::CallbackMode::Inline,
        spin,
        ..rcm::FabricConfig::default()
    };
    let client = Client::connect_for(path, &cfg).expect("session");
    rcm::Fabric::with_provider(std::sync::Arc::new(client), cfg)
}

/// Inline callbacks run on the reader before it waits on the socket, including when what
/// it read ends inside a frame: the rest of that frame may come only later (here the fake
/// daemon sends it once the first event's callback has run; a daemon's write cut by a full
/// socket is another way). Before, the batch ended only on an empty buffer, so the first
/// callback waited for the rest of the second frame: here for good.
#[test]
fn inline_callbacks_do_not_wait_for_the_rest_of_a_cut_frame() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let (path, listener) = fake_listener("cut-frame");
    let ran = Arc::new(AtomicUsize::new(0));
    let seen = ran.clone();
    let (created, go) = mpsc::channel::<()>();
    let daemon = std::thread::spawn(move || {
        let (mut s, c, event) = session_channel_and_one_id(&listener, &go);
        // One event and half of the next, in one write; the rest once the first callback ran.
        let half = event.len() / 2;
        let mut first = event.clone();
        first.extend_from_slice(&event[..half]);
        s.write_all(&first).expect("events");
        let t0 = Instant::now();
        while seen.load(Ordering::SeqCst) == 0 {
            if t0.elapsed() > Duration::from_secs(10) {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let ran_first = seen.load(Ordering::SeqCst) == 1;
        s.write_all(&event[half..]).expect("the rest");
        (ran_first, s, c)
    });
    let f = inline_fabric(&path, rcm::FabricConfig::default().spin);
    let _id = f
        .try_create_id(rcm::PortSpace::Tcp, move |_, ev| {
            if matches!(ev, rcm::Event::AddrResolved) {
                ran.fetch_add(1, Ordering::SeqCst);
            }
            rcm::Flow::Continue
        })
        .expect("create");
    created.send(()).expect("tell the fake daemon");
    let (ran_first, _s, _c) = daemon.join().expect("fake daemon");
    assert!(
        ran_first,
        "the first event's callback waited for the rest of the next frame"
    );
    let _ = std::fs::remove_file(&path);
}

/// With inline callbacks, a callback on the reader waits for a lock that an application
/// thread holds while it makes calls, and the daemon dies: the calls on the dead channel
/// fail, and the next one (no channel attaches any more, so it waits on the session's
/// connection, whose answers the held reader would read) fails too instead of waiting for
/// good. It waited for ever: the reader, held by the callback, never read the daemon's
/// end, and the caller never let go of the lock.
#[test]
fn a_call_waiting_behind_a_held_reader_fails_when_the_daemon_dies() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let (path, listener) = fake_listener("held-reader");
    let (created, go) = mpsc::channel::<()>();
    let daemon_path = path.clone();
    let daemon = std::thread::spawn(move || {
        let (mut s, mut c, event) = session_channel_and_one_id(&listener, &go);
        s.write_all(&event).expect("event");
        // The call made under the lock comes on the channel; then the daemon is gone.
        let (_, call) = read_command(&mut c);
        assert!(
            matches!(call, Command::CreateIdAs(rcm::PortSpace::Tcp, _)),
            "{call:?}"
        );
        drop(listener);
        let _ = std::fs::remove_file(&daemon_path);
    });
    let f = inline_fabric(&path, rcm::FabricConfig::default().spin);
    let app_lock = Arc::new(Mutex::new(()));
    let entered = Arc::new(AtomicBool::new(false));
    let (l, e) = (app_lock.clone(), entered.clone());
    let _id = f
        .try_create_id(rcm::PortSpace::Tcp, move |_, ev| {
            if matches!(ev, rcm::Event::AddrResolved) {
                e.store(true, Ordering::SeqCst);
                drop(l.lock());
            }
            rcm::Flow::Continue
        })
        .expect("create");
    let (results, got) = mpsc::channel();
    let (locked, is_locked) = mpsc::channel();
    let f2 = f.clone();
    let l = app_lock.clone();
    let e = entered.clone();
    std::thread::spawn(move || {
        let _held = l.lock().expect("the application's lock");
        locked.send(()).expect("tell");
        // The reader's callback is now waiting for this lock.
        let t0 = Instant::now();
        while !e.load(Ordering::SeqCst) && t0.elapsed() < T {
            std::thread::sleep(Duration::from_millis(1));
        }
        let first = f2.try_create_id(rcm::PortSpace::Tcp, |_, _| rcm::Flow::Continue);
        let second = f2.try_create_id(rcm::PortSpace::Tcp, |_, _| rcm::Flow::Continue);
        let _ = results.send((first.err(), second.err()));
    });
    is_locked.recv_timeout(T).expect("locked");
    created.send(()).expect("tell the fake daemon");
    daemon.join().expect("fake daemon");
    let (first, second) = got
        .recv_timeout(Duration::from_secs(10))
        .expect("the calls made under the lock returned (they waited for good)");
    assert_eq!(
        first,
        Some(rcm::Error::DeviceRemoved),
        "on the dead channel"
    );
    assert_eq!(second, Some(rcm::Error::DeviceRemoved), "on the session");
    f.shutdown();
}

/// The session's frames are put together however the daemon's bytes arrive: here 20 events
/// behind a 40,000-byte frame (longer than the client's receive buffer; an event that does
/// not decode, so it is skipped), all written a few bytes at a time.
#[test]
fn frames_cut_anywhere_and_longer_than_the_buffer_are_read_whole() {
    const EVENTS: usize = 20;
    let (path, client, f, mut s) = fake_session("cut-bytes");
    let ch = rcm::EventChannel::new();
    let maker = {
        let (f, ch) = (f.clone(), ch.clone());
        std::thread::spawn(move || f.try_create_id_on(rcm::PortSpace::Tcp, &ch))
    };
    let (seq, cmd) = read_command(&mut s);
    assert_eq!(cmd, Command::CreateIdAs(rcm::PortSpace::Tcp, FIRST));
    s.write_all(&Message::Ok(proto::Answer::Handle(FIRST)).encode(seq))
        .expect("reply");
    let id = maker.join().expect("maker").expect("create");
    let mut bytes = frame(proto::kind::EVENT, 0, &vec![0xEE; 40_000]);
    for _ in 0..EVENTS {
        let ev = Message::Event {
            handle: FIRST,
            event: proto::WireEvent::AddrResolved,
            qp: None,
        };
        bytes.extend_from_slice(&ev.encode(0));
    }
    let writer = std::thread::spawn(move || {
        let mut rest = &bytes[..];
        let mut n = 0;
        while !rest.is_empty() {
            // 1 to 13 bytes at a time; the long frame's body in larger pieces.
            let len = if rest.len() > 2_000 { 997 } else { 1 + n % 13 };
            let (now, later) = rest.split_at(len.min(rest.len()));
            s.write_all(now).expect("write");
            rest = later;
            n += 1;
            std::thread::sleep(Duration::from_micros(50));
        }
        s
    });
    for k in 0..EVENTS {
        let e = ch
            .get_event(Some(T))
            .unwrap_or_else(|| panic!("{k} of {EVENTS} events came"));
        assert!(matches!(e.event(), rcm::Event::AddrResolved), "{e:?}");
        assert_eq!(e.id(), &id);
    }
    assert!(client.is_alive());
    let _s = writer.join().expect("writer");
    let _ = std::fs::remove_file(&path);
}

/// What a call from a callback returned, and whether the fake daemon had let its silent
/// channel go by then.
type CallResult = (rcm::Result<()>, bool);

/// An id whose callback, on ADDR_RESOLVED, calls `resolve_route` and sends what it
/// returned and whether the fake daemon had `released` its silent channel by then.
fn id_calling_on_its_event(
    f: &rcm::Fabric,
    released: &std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> (rcm::CmId, mpsc::Receiver<CallResult>) {
    let (results, got) = mpsc::channel();
    let rel = released.clone();
    let id = f
        .try_create_id(rcm::PortSpace::Tcp, move |id, ev| {
            if matches!(ev, rcm::Event::AddrResolved) {
                let r = id.resolve_route();
                let _ = results.send((r, rel.load(std::sync::atomic::Ordering::SeqCst)));
            }
            rcm::Flow::Continue
        })
        .expect("create");
    (id, got)
}

/// With inline callbacks, what ends the session (a frame that cannot be one) comes in the
/// same read as an event: the session is marked over before that event's callback runs, so a
/// call the callback makes fails as `DeviceRemoved` at once, instead of going to a command
/// channel that is still open but will never answer (here the fake daemon holds it, silent,
/// until the test has its answer).
#[test]
fn calls_from_the_callbacks_of_the_last_batch_fail_at_once() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let (path, listener) = fake_listener("last-batch");
    let (created, go) = mpsc::channel::<()>();
    let (finish, finished) = mpsc::channel::<()>();
    let released = Arc::new(AtomicBool::new(false));
    let rel = released.clone();
    let daemon = std::thread::spawn(move || {
        let (mut s, c, event) = session_channel_and_one_id(&listener, &go);
        // The event and a header whose length is too short for one, in one write.
        let mut bytes = event;
        bytes.extend_from_slice(&[0u8; 12]);
        s.write_all(&bytes).expect("event");
        // The channel stays open and silent until the test has its answer (or 10 s).
        let _ = finished.recv_timeout(T);
        rel.store(true, Ordering::SeqCst);
        drop((c, s));
    });
    let f = inline_fabric(&path, rcm::FabricConfig::default().spin);
    let (_id, got) = id_calling_on_its_event(&f, &released);
    created.send(()).expect("tell the fake daemon");
    let (r, after_release) = got
        .recv_timeout(Duration::from_secs(30))
        .expect("the callback ran");
    let _ = finish.send(());
    daemon.join().expect("fake daemon");
    assert!(
        !after_release,
        "the call waited for the silent channel to close"
    );
    assert_eq!(r, Err(rcm::Error::DeviceRemoved));
    let _ = std::fs::remove_file(&path);
}

/// Inline callbacks run on the session's reader even for the first events after the first
/// command channel attached while the reader was polling (here a long poll, so that every
/// step of the test falls inside it). The reader decided whether to run a batch's
/// callbacks itself once before its poll, so the batch went to the dispatcher, where a
/// callback's call could race the reader's finding that the session was over (the cause
/// of `calls_from_the_callbacks_of_the_last_batch_fail_at_once` failing now and then).
#[test]
fn inline_callbacks_run_on_the_reader_when_a_channel_attached_during_its_poll() {
    let (path, listener) = fake_listener("attach-while-polling");
    let (created, go) = mpsc::channel::<()>();
    let (finish, finished) = mpsc::channel::<()>();
    let daemon = std::thread::spawn(move || {
        let (mut s, c, event) = session_channel_and_one_id(&listener, &go);
        s.write_all(&event).expect("event");
        let _ = finished.recv_timeout(T);
        drop((c, s));
    });
    let f = inline_fabric(&path, Duration::from_secs(1));
    let (ran_on, got) = mpsc::channel();
    let _id = f
        .try_create_id(rcm::PortSpace::Tcp, move |_, ev| {
            if matches!(ev, rcm::Event::AddrResolved) {
                let _ = ran_on.send(std::thread::current().name().map(str::to_owned));
            }
            rcm::Flow::Continue
        })
        .expect("create");
    created.send(()).expect("tell the fake daemon");
    let thread = got.recv_timeout(T).expect("the callback ran");
    let _ = finish.send(());
    daemon.join().expect("fake daemon");
    assert_eq!(thread.as_deref(), Some("rcm-ucm-client"));
    let _ = std::fs::remove_file(&path);
}

/// What the id `b` of one round of
/// `calls_from_callbacks_of_what_a_waiter_received_last_fail_at_once` saw.
enum Seen {
    /// Its `ADDR_RESOLVED` callback ran: what its call returned, and whether that came only
    /// after the fake daemon let the silent channel go.
    Called(CallResult),
    /// Its `DEVICE_REMOVAL` came while `ADDR_RESOLVED` was still queued, which it replaced:
    /// no callback of that event ran.
    Replaced,
}

/// One round of `calls_from_callbacks_of_what_a_waiter_received_last_fail_at_once`: what
/// `b` saw, the frames the waiter received itself, and the event the waiter got.
fn last_polled_round(round: usize) -> (Seen, u64, Option<&'static str>) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let (path, listener) = fake_listener(&format!("last-polled-{round}"));
    let (finish, finished) = mpsc::channel::<()>();
    let released = Arc::new(AtomicBool::new(false));
    let rel = released.clone();
    let daemon = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("session");
        open_session(&mut s);
        let (mut c, _) = listener.accept().expect("channel");
        // A create gets the handle it names.
        let answer = |c: &mut UnixStream, a: proto::Answer| {
            let (seq, cmd) = read_command(c);
            let a = match cmd {
                Command::CreateIdAs(_, h) => proto::Answer::Handle(h),
                _ => a,
            };
            c.write_all(&Message::Ok(a).encode(seq)).expect("answer");
            cmd
        };
        let done = || proto::Answer::Reply(rcm::remote::Reply::Done);
        assert!(matches!(answer(&mut c, done()), Command::Attach { .. }));
        refuse_map(&mut c);
        assert!(matches!(
            answer(&mut c, done()),
            Command::CreateIdAs(_, FIRST)
        ));
        assert!(matches!(
            answer(&mut c, done()),
            Command::CreateIdAs(_, h) if h == FIRST + 1
        ));
        let bind = answer(&mut c, done());
        assert!(
            matches!(bind, Command::Call(FIRST, rcm::remote::Op::Bind(_))),
            "{bind:?}"
        );
        // The waiter polls by now (it began as the answer came).
        std::thread::sleep(Duration::from_millis(200));
        let mut bytes = Message::Event {
            handle: FIRST + 1,
            event: proto::WireEvent::AddrResolved,
            qp: None,
        }
        .encode(0);
        bytes.extend_from_slice(&[0u8; 12]);
        s.write_all(&bytes).expect("event");
        let _ = finished.recv_timeout(T);
        rel.store(true, Ordering::SeqCst);
        drop((c, s));
    });
    let client = Client::connect(&path).expect("session");
    let f = rcm::Fabric::with_provider(Arc::new(client.clone()), rcm::FabricConfig::default());
    let ch = rcm::EventChannel::new();
    ch.set_spin(T);
    let a = f
        .try_create_id_on(rcm::PortSpace::Tcp, &ch)
        .expect("create");
    let (seen, got) = mpsc::channel();
    let _b = f
        .try_create_id(rcm::PortSpace::Tcp, move |id, ev| {
            match ev {
                rcm::Event::AddrResolved => {
                    let r = id.resolve_route();
                    let _ = seen.send(Seen::Called((r, released.load(Ordering::SeqCst))));
                }
                rcm::Event::DeviceRemoval => {
                    let _ = seen.send(Seen::Replaced);
                }
                _ => {}
            }
            rcm::Flow::Continue
        })
        .expect("create");
    let waiter = std::thread::spawn(move || {
        a.bind(sa(1, 0)).expect("bind");
        ch.get_event(Some(T)).map(|e| e.event().name())
    });
    let seen = got
        .recv_timeout(Duration::from_secs(30))
        .expect("b saw one of its events");
    let _ = finish.send(());
    daemon.join().expect("fake daemon");
    let waited_for = waiter.join().expect("waiter");
    let _ = std::fs::remove_file(&path);
    (seen, client.busy_polled(), waited_for)
}

/// The same with the frames received by a thread busy polling in `get_event` (callbacks of
/// the events such a thread receives run on the dispatcher, at once): the session is over
/// before the event ahead of the frame that cannot be one is delivered, so the call its
/// callback makes fails as `DeviceRemoved` instead of waiting on the silent channel.
///
/// The session's end is a `DEVICE_REMOVAL`, which replaces events still queued: when it
/// comes before a dispatcher thread started the callback of `ADDR_RESOLVED` (on a loaded
/// machine, one round in five), that callback never runs and the round proves nothing. So
/// rounds are played until one has the callback run with the frames received by the
/// waiter; every round whose callback ran must have its call fail at once.
#[test]
fn calls_from_callbacks_of_what_a_waiter_received_last_fail_at_once() {
    const ROUNDS: usize = 40;
    for round in 0..ROUNDS {
        let (seen, polled, waited_for) = last_polled_round(round);
        assert_eq!(
            waited_for,
            Some("DEVICE_REMOVAL"),
            "the waiter's id learns the session is over"
        );
        let Seen::Called((r, after_release)) = seen else {
            continue;
        };
        assert!(
            !after_release,
            "the call waited for the silent channel to close"
        );
        assert_eq!(r, Err(rcm::Error::DeviceRemoved));
        if polled >= 1 {
            return;
        }
    }
    panic!("in {ROUNDS} rounds, none had the waiter receive the frames and the callback run");
}

/// The fake daemon's answer to the client's next command, a TCP `CREATE_ID` naming its
/// handle: that handle.
fn answer_create(s: &mut UnixStream) -> u32 {
    let (seq, cmd) = read_command(s);
    let Command::CreateIdAs(rcm::PortSpace::Tcp, h) = cmd else {
        panic!("expected a create naming its handle, got {cmd:?}");
    };
    s.write_all(&Message::Ok(proto::Answer::Handle(h)).encode(seq))
        .expect("handle");
    h
}

/// A destroyed id's handle is not chosen again while events of that id may still be on
/// their way to the client (protocol §8): not while its `DESTROY_ID` is unanswered, nor
/// until the client has taken as many events as the answer counts; after that it is, and
/// the late event went to no id. Before, the client let go of the handle as the id was
/// released: a create whose counter came round to it took it at once, and the old id's
/// late event went to the new id.
#[test]
fn a_destroyed_ids_handle_waits_for_the_ids_late_events() {
    use rcm::PortSpace::Tcp;
    let (path, client, f, mut s) = fake_session("handle-reuse");
    let create_on = |ch: &rcm::EventChannel| {
        let (f, ch) = (f.clone(), ch.clone());
        std::thread::spawn(move || f.try_create_id_on(Tcp, &ch).expect("create"))
    };
    let (cha, chb, chc, chd) = (
        rcm::EventChannel::new(),
        rcm::EventChannel::new(),
        rcm::EventChannel::new(),
        rcm::EventChannel::new(),
    );
    let a = create_on(&cha);
    assert_eq!(answer_create(&mut s), FIRST);
    let a = a.join().expect("a");
    // A is destroyed. While its destroy waits for the answer, the counter comes round.
    let destroyer = std::thread::spawn(move || a.destroy());
    let (dseq, cmd) = read_command(&mut s);
    assert_eq!(cmd, Command::DestroyId(FIRST));
    client.set_handle_counter(0);
    let b = create_on(&chb);
    assert_eq!(
        answer_create(&mut s),
        FIRST + 1,
        "A's handle was chosen while its destroy was unanswered"
    );
    let b = b.join().expect("b");
    // One event was written to the session before A's handle went; the client has not
    // taken it yet.
    s.write_all(&Message::Ok(proto::Answer::Released { events: 1 }).encode(dseq))
        .expect("released");
    destroyer.join().expect("destroyer").expect("destroy");
    client.set_handle_counter(0);
    let c = create_on(&chc);
    assert_eq!(
        answer_create(&mut s),
        FIRST + 2,
        "A's handle was chosen before A's last event was taken"
    );
    let c = c.join().expect("c");
    // A's late event, then one for B: once B has its own, A's was taken.
    for h in [FIRST, FIRST + 1] {
        let ev = Message::Event {
            handle: h,
            event: proto::WireEvent::AddrResolved,
            qp: None,
        };
        s.write_all(&ev.encode(0)).expect("event");
    }
    let e = chb.get_event(Some(T)).expect("B's event");
    assert_eq!(e.id(), &b);
    assert!(matches!(e.event(), rcm::Event::AddrResolved), "{e:?}");
    let quiet = Some(Duration::from_millis(100));
    assert!(chc.get_event(quiet).is_none(), "A's late event went to C");
    assert!(cha.get_event(quiet).is_none(), "A's late event went to A");
    // Now A's handle is free again.
    client.set_handle_counter(0);
    let d = create_on(&chd);
    assert_eq!(
        answer_create(&mut s),
        FIRST,
        "A's handle stayed out of use after its events were taken"
    );
    let d = d.join().expect("d");
    // The daemon goes: the ids' destroys need no answers.
    drop(s);
    drop((b, c, d, f));
    let _ = std::fs::remove_file(&path);
}

/// A destroy that a callback on the session's reader asks for when no command channel can
/// be had goes on the session's connection, with nobody waiting for its answer: that answer
/// still lets the handle go once the events it counts were taken (protocol §8), instead of
/// the handle staying out of use for the session's life.
#[test]
fn a_destroy_sent_from_the_reader_without_a_channel_lets_its_handle_go() {
    use std::sync::Arc;
    let (path, listener) = fake_listener("reader-release");
    let (created, go) = mpsc::channel::<()>();
    let daemon = std::thread::spawn(move || {
        let (mut s, c, event) = session_channel_and_one_id(&listener, &go);
        // The channel goes and no other is let in: the callback's call fails on it, and
        // the destroy has only the session's connection.
        drop(c);
        std::thread::spawn(move || refuse_channels(&listener));
        s.write_all(&event).expect("event");
        let (seq, cmd) = read_command(&mut s);
        assert_eq!(cmd, Command::DestroyId(FIRST));
        // The event written before it is the one the callback ran for.
        let released = Message::Ok(proto::Answer::Released { events: 1 });
        s.write_all(&released.encode(seq)).expect("released");
        s
    });
    let cfg = rcm::FabricConfig {
        callbacks: rcm::CallbackMode::Inline,
        ..rcm::FabricConfig::default()
    };
    let client = Client::connect_for(&path, &cfg).expect("session");
    let f = rcm::Fabric::with_provider(Arc::new(client.clone()), cfg);
    let (ran, got) = mpsc::channel();
    let id = f
        .try_create_id(rcm::PortSpace::Tcp, move |id, ev| {
            if !matches!(ev, rcm::Event::AddrResolved) {
                return rcm::Flow::Continue;
            }
            let _ = ran.send(id.resolve_route());
            rcm::Flow::Destroy
        })
        .expect("create");
    created.send(()).expect("tell the fake daemon");
    let r = got.recv_timeout(T).expect("the callback ran");
    assert!(r.is_err(), "a call on the closed channel: {r:?}");
    let s = daemon.join().expect("fake daemon");
    wait_until(
        || client.held_ids() == 0 && client.handles_draining() == 0,
        || format!("{} handles held back", client.handles_draining()),
    );
    assert_eq!(client.mapped_channels(), 0);
    drop((s, id, f));
    let _ = std::fs::remove_file(&path);
}

/// How a destroy's other answers settle its handle (protocol §8): `ERR NoSuchId` (the
/// daemon did not hold it, so nothing of it can be on its way) lets the handle go at once;
/// an answer that says nothing of the events (here a version-6 `OK Done`) keeps it out of
/// use for the session's life rather than guess.
#[test]
fn a_destroy_answered_no_such_id_frees_its_handle_and_a_bad_answer_keeps_it() {
    use rcm::PortSpace::Tcp;
    let (path, client, f, mut s) = fake_session("handle-settle");
    let ch = rcm::EventChannel::new();
    // A create from another thread (the fake answers it here), with the handle it named.
    let create = |s: &mut UnixStream| {
        let (f, ch) = (f.clone(), ch.clone());
        let t = std::thread::spawn(move || f.try_create_id_on(Tcp, &ch).expect("create"));
        let h = answer_create(s);
        (h, t.join().expect("creator"))
    };
    // Destroys `id` from another thread, answering its DESTROY_ID with `answer`.
    let destroy = |s: &mut UnixStream, id: rcm::CmId, h: u32, answer: Message| {
        let t = std::thread::spawn(move || id.destroy());
        let (seq, cmd) = read_command(s);
        assert_eq!(cmd, Command::DestroyId(h));
        s.write_all(&answer.encode(seq)).expect("answer");
        t.join().expect("destroyer").expect("destroy");
    };
    let (h, a) = create(&mut s);
    assert_eq!(h, FIRST);
    destroy(&mut s, a, h, Message::Err(WireError::NoSuchId));
    client.set_handle_counter(0);
    let (h, b) = create(&mut s);
    assert_eq!(
        h, FIRST,
        "a handle the daemon did not hold was kept out of use"
    );
    let done = Message::Ok(proto::Answer::Reply(rcm::remote::Reply::Done));
    destroy(&mut s, b, h, done);
    assert_eq!(client.handles_draining(), 1);
    client.set_handle_counter(0);
    let (h, c) = create(&mut s);
    assert_eq!(
        h,
        FIRST + 1,
        "a handle whose destroy's answer said nothing was reused"
    );
    drop(s);
    drop((c, f));
    let _ = std::fs::remove_file(&path);
}
