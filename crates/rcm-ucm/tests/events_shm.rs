//! A session's events in shared memory (`MAP_EVENTS`, §2.3 of `docs/ucm-protocol.md`): the
//! client library maps them by default; the daemon's rules for the command; what the daemon
//! writes goes into the ring in order, a full ring holds up only that session, a sleeping
//! client is rung for; and a client never trusts what a daemon wrote in that memory.

mod common;

use common::*;
use rcm::remote::Reply;
use rcm_shm::{Consumer, Region};
use rcm_ucm::proto::{self, Answer, Command, Limits, Message, WireError, WireEvent};
use rcm_ucm::raw::RawSession;
use rcm_ucm::shmchan::{EVENTS, EVENTS_REGION_BYTES};
use rcm_ucm::{Client, Daemon};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// A raw session whose events are mapped: the session, its token and the events ring.
fn mapped_session(d: &Daemon) -> (RawSession, u64, Consumer) {
    let (mut s, token) = raw(d);
    let (m, region) = s.map_events().expect("map events");
    assert_eq!(m, Message::Ok(Answer::Reply(Reply::Done)), "mapped");
    let region = Arc::new(region.expect("the memory came with the answer"));
    (s, token, Consumer::new(region, EVENTS).expect("consumer"))
}

#[test]
fn a_sessions_events_go_through_shared_memory_by_default() {
    let d = daemon("ev-default", 49401, &[1]);
    let client = Client::connect(d.socket()).expect("session");
    assert!(
        client.events_mapped(),
        "the session's events were not mapped"
    );
    assert!(d.mapped_sessions() >= 1);
    // Whole connections between two clients, their events all through rings.
    round_trip(&d, sa(1, 7401));
    assert!(d.mapped_sessions() >= 3, "{} mapped", d.mapped_sessions());
    drop(client);
    // A daemon that keeps sessions on their sockets: the same, over the socket.
    let mut cfg = config("ev-off", 49402, &[1]);
    cfg.shared_memory = false;
    let d2 = Daemon::start(cfg).expect("daemon");
    let client = Client::connect(d2.socket()).expect("session");
    assert!(!client.events_mapped());
    round_trip(&d2, sa(1, 7402));
    assert_eq!(d2.mapped_sessions(), 0);
    let (mut s, _) = raw(&d2);
    let (m, region) = s.map_events().expect("map events");
    assert!(matches!(m, Message::Err(WireError::BadMessage(_))), "{m:?}");
    assert!(region.is_none(), "memory sent with a refusal");
}

/// `MAP_EVENTS` only on a session's own connection, before its first credit, once; after
/// it, the session's answers come in the ring and the socket stays silent.
#[test]
fn map_events_rules() {
    let d = daemon("ev-rules", 49403, &[1]);
    // After the first GET_EVENT: too late (an event may be on the socket).
    let (mut late, token) = raw(&d);
    late.send(&Command::GetEvent(4)).expect("credit");
    let (m, region) = late.map_events().expect("map events");
    assert!(matches!(m, Message::Err(WireError::BadMessage(_))), "{m:?}");
    assert!(region.is_none());
    assert!(matches!(
        ok(&mut late, &Command::Devices),
        Answer::Devices(_)
    ));
    // On a command channel: refused, the channel goes on.
    let mut c = channel(&d, token);
    let (m, region) = c.map_events().expect("map events");
    assert!(matches!(m, Message::Err(WireError::BadMessage(_))), "{m:?}");
    assert!(region.is_none());
    assert!(matches!(ok(&mut c, &Command::Devices), Answer::Devices(_)));
    // Mapped: a second time is refused, in the ring; answers come in the ring only.
    let (mut s, _, mut rx) = mapped_session(&d);
    let seq = s.send(&Command::MapEvents).expect("send");
    let (got, m) = next_frame(&mut rx);
    assert_eq!(got, seq);
    assert!(matches!(m, Message::Err(WireError::BadMessage(_))), "{m:?}");
    let seq = s.send(&Command::Stats).expect("send");
    let (got, m) = next_frame(&mut rx);
    assert_eq!(got, seq);
    assert!(matches!(m, Message::Ok(Answer::Stats(_))), "{m:?}");
    assert_silent(&mut s, Duration::from_millis(200));
    // Events too, under credit as before.
    let seq = s
        .send(&Command::CreateId(rcm::PortSpace::Tcp))
        .expect("send");
    let (got, m) = next_frame(&mut rx);
    assert_eq!(got, seq);
    let Message::Ok(Answer::Handle(h)) = m else {
        panic!("{m:?}")
    };
    s.send(&Command::Call(
        h,
        rcm::remote::Op::ResolveAddr {
            src: None,
            dst: sa(1, 7403),
        },
    ))
    .expect("send");
    let (_, m) = next_frame(&mut rx);
    assert!(matches!(m, Message::Ok(_)), "{m:?}");
    assert!(!rx.has_data(), "an event without credit");
    s.send(&Command::GetEvent(1)).expect("credit");
    let (got, m) = next_frame(&mut rx);
    assert_eq!(got, 0, "events carry seq 0");
    assert!(
        matches!(
            m,
            Message::Event {
                handle,
                event: WireEvent::AddrResolved,
                ..
            } if handle == h
        ),
        "{m:?}"
    );
    assert_silent(&mut s, Duration::from_millis(100));
}

/// A client whose ring sleeps is woken by a doorbell byte on the socket.
#[test]
fn a_sleeping_session_is_rung_for() {
    let d = daemon("ev-bell", 49404, &[1]);
    let (mut s, _, mut rx) = mapped_session(&d);
    for round in 0..3 {
        assert!(rx.prepare_sleep(), "nothing is due");
        let seq = s.send(&Command::Devices).expect("send");
        wait_doorbell(s.stream(), &format!("round {round}"));
        rx.awake();
        let (got, m) = next_frame(&mut rx);
        assert_eq!(got, seq);
        assert!(matches!(m, Message::Ok(Answer::Devices(_))), "{m:?}");
    }
}

/// A client that does not read its ring: the daemon's answers wait for room (holding up
/// that session only), an event waits in the queue, and once the client reads it gets
/// everything in order.
#[test]
fn a_full_events_ring_holds_up_that_session_only() {
    let limits = Limits {
        max_queued_events: 10_000,
        ..Limits::default()
    };
    let d = daemon_with_limits("ev-full", 49405, &[1], limits);
    let (mut s, token, mut rx) = mapped_session(&d);
    let seq0 = s
        .send(&Command::CreateId(rcm::PortSpace::Tcp))
        .expect("send");
    let (_, m) = next_frame(&mut rx);
    let Message::Ok(Answer::Handle(h)) = m else {
        panic!("{m:?}")
    };
    s.send(&Command::GetEvent(100)).expect("credit");
    // ~64 bytes each: 6,000 answers are more than the 256 KiB ring holds. Sent in one write
    // (thousands of small ones would fill the socket's buffer with their overhead).
    let n = 6000u32;
    let first = seq0 + 100;
    let cmds: Vec<u8> = (first..first + n)
        .flat_map(|q| Command::Stats.encode(q))
        .collect();
    s.send_bytes(&cmds).expect("send");
    // The session's reader is now held, waiting for room; a channel of the same session
    // still carries calls, and their event waits behind the answers.
    let mut c = channel(&d, token);
    wait_until(
        || {
            let st = ok(&mut c, &Command::Stats);
            matches!(st, Answer::Stats(st) if st.commands >= u64::from(n) / 2)
        },
        || "the session's commands are not read".into(),
    );
    assert!(matches!(
        ok(
            &mut c,
            &Command::Call(
                h,
                rcm::remote::Op::ResolveAddr {
                    src: None,
                    dst: sa(1, 7405)
                }
            )
        ),
        Answer::Reply(_)
    ));
    // Other clients are served meanwhile.
    round_trip(&d, sa(1, 7406));
    let mut want = first;
    let mut event = false;
    while want < first + n || !event {
        let (got, m) = next_frame(&mut rx);
        if got == 0 {
            assert!(
                matches!(m, Message::Event { handle, event: WireEvent::AddrResolved, .. } if handle == h),
                "{m:?}"
            );
            event = true;
            continue;
        }
        assert_eq!(got, want, "answers out of order");
        assert!(matches!(m, Message::Ok(Answer::Stats(_))), "{m:?}");
        want += 1;
    }
}

/// A fake daemon that maps a session's events into memory it then writes garbage into:
/// the client ends the session (a device removal for its ids), and nothing panics.
#[test]
fn a_client_ends_the_session_on_a_broken_events_ring() {
    for spoil in 0..3 {
        let path = sock(&format!("ev-broken-{spoil}"));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).expect("listen");
        let fake = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("session");
            let region = open_fake_session(&mut s, |s, seq| {
                let (region, fd) =
                    Region::create("fake-events", EVENTS_REGION_BYTES).expect("memfd");
                let done = Message::Ok(Answer::Reply(Reply::Done)).encode(seq);
                send_with_fd(s, &done, &fd);
                (region, fd)
            });
            let (region, fd) = region;
            // Command channels are refused: the client's calls come on the session.
            std::thread::spawn(move || refuse_channels(&listener));
            let mut tx = rcm_shm::Producer::new(Arc::new(region), EVENTS).expect("producer");
            // The client's CreateId, answered in the ring (a byte on the socket for its
            // reader, asleep or not).
            let (seq, create) = read_command(&mut s);
            let first = proto::CLIENT_HANDLES;
            assert_eq!(create, Command::CreateIdAs(rcm::PortSpace::Tcp, first));
            tx.push(&Message::Ok(Answer::Handle(first)).encode(seq))
                .expect("push")
                .expect("room");
            s.write_all(&[1]).expect("doorbell");
            // Until the client has the id (an event for a handle it has not filed yet
            // would be dropped, not delivered).
            let (_, query) = read_command(&mut s);
            assert!(
                matches!(query, Command::Call(h, _) if h == first),
                "{query:?}"
            );
            match spoil {
                // Not a frame of the protocol.
                0 => {
                    tx.push(&[0xFF; 40]).expect("push");
                }
                // A frame whose header says another length.
                1 => {
                    let mut f = Message::Ok(Answer::Reply(Reply::Done)).encode(5);
                    f.extend_from_slice(&[0; 8]);
                    tx.push(&f).expect("push");
                }
                // An index out of range.
                _ => {
                    let r = Region::open(&fd, EVENTS_REGION_BYTES).expect("open");
                    r.u32_at(EVENTS.ctl).store(0x7FFF_FFFF, Ordering::SeqCst);
                }
            }
            let _ = s.write_all(&[1]);
            // Held open: the client must end the session on what it read alone, and close
            // its connection, so that a real daemon ends the session's ids at once.
            closed_by_client(&mut s)
        });
        let client = Client::connect(&path).expect("session");
        assert!(client.events_mapped());
        let f = rcm::Fabric::with_provider(Arc::new(client.clone()), rcm::FabricConfig::default());
        let ch = rcm::EventChannel::new();
        let id = f.create_id_on(rcm::PortSpace::Tcp, &ch);
        // Sent for the fake daemon to go on; its answer never comes, the session ends.
        let r = id.set_reuseaddr(true);
        assert_eq!(r, Err(rcm::Error::DeviceRemoved), "spoil {spoil}");
        wait_until(
            || !client.is_alive(),
            || format!("spoil {spoil}: the session goes on"),
        );
        let e = next(&ch);
        assert!(matches!(e.event(), rcm::Event::DeviceRemoval), "{e:?}");
        drop(e);
        // The fabric is still held: the connection was closed by the session's end itself.
        assert!(
            fake.join().expect("the fake daemon"),
            "spoil {spoil}: the session ended but its connection stayed open"
        );
        f.shutdown();
        let _ = std::fs::remove_file(&path);
    }
}

/// A fake daemon's side of a session whose events it maps (`open_fake_session` with the
/// memory sent), command channels refused: the events ring to write into, and the memory.
fn fake_mapped_session(
    s: &mut UnixStream,
    listener: UnixListener,
) -> (rcm_shm::Producer, Arc<Region>) {
    let (region, _fd) = open_fake_session(s, |s, seq| {
        let (region, fd) = Region::create("fake-events", EVENTS_REGION_BYTES).expect("memfd");
        let done = Message::Ok(Answer::Reply(Reply::Done)).encode(seq);
        send_with_fd(s, &done, &fd);
        (region, fd)
    });
    std::thread::spawn(move || refuse_channels(&listener));
    let region = Arc::new(region);
    let tx = rcm_shm::Producer::new(region.clone(), EVENTS).expect("producer");
    (tx, region)
}

/// Writes `f` into the events ring as the daemon does: published, then the doorbell rung
/// if the ring says the client sleeps.
fn push_ringing(tx: &mut rcm_shm::Producer, s: &mut UnixStream, f: &[u8]) {
    if tx.push(f).expect("push").expect("room") {
        s.write_all(&[1]).expect("doorbell");
    }
}

/// Answers the client's first two calls (its CreateId, then one more) in the ring.
fn answer_create_and_one_call(tx: &mut rcm_shm::Producer, s: &mut UnixStream) {
    for _ in 0..2 {
        let (seq, cmd) = read_command(s);
        let a = match cmd {
            Command::CreateIdAs(_, h) => Answer::Handle(h),
            _ => Answer::Reply(Reply::Done),
        };
        push_ringing(tx, s, &Message::Ok(a).encode(seq));
    }
}

/// Until the session's reader sleeps on its socket (the ring marked asleep).
fn wait_reader_asleep(region: &Region) {
    wait_until(
        || events_ring_asleep(region),
        || "the session's reader never slept".into(),
    );
}

/// The other end of `s` closed it within `T` (end of stream), whatever came before.
fn closed_by_client(s: &mut UnixStream) -> bool {
    s.set_read_timeout(Some(T)).expect("timeout");
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
    }
}

/// A thread waiting for an event polls the session itself while the reader sleeps on the
/// socket; the daemon breaks the ring without ringing. The waiter that finds it broken
/// ends the session: the connection is closed (an unpark would not end the reader's
/// poll(2)), so the reader wakes and every id gets its `DeviceRemoval`, and the daemon sees
/// the end. Before, the id never heard of it and the daemon kept the session.
///
/// The ring is broken before the wait begins, and the wait begins only once this thread
/// may poll: its first look finds it. (Broken during the wait, a waiter held off polling
/// by CPU-bound neighbours, see `rcm::spin_allowed`, sleeps instead, and nothing rings:
/// under two busy loops the test failed so, in 4 runs of 4.)
#[test]
fn a_broken_ring_found_by_a_polling_waiter_ends_the_session() {
    let path = sock("ev-broken-by-waiter");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).expect("listen");
    let (asleep_tx, asleep) = std::sync::mpsc::channel::<()>();
    let (go_tx, go) = std::sync::mpsc::channel::<()>();
    let (broken_tx, broken) = std::sync::mpsc::channel::<()>();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("session");
        let (mut tx, region) = fake_mapped_session(&mut s, listener);
        answer_create_and_one_call(&mut tx, &mut s);
        wait_reader_asleep(&region);
        asleep_tx.send(()).expect("asleep");
        go.recv().expect("go");
        // The producer's index out of range, no doorbell.
        region
            .u32_at(EVENTS.ctl)
            .store(0x7FFF_FFFF, Ordering::SeqCst);
        broken_tx.send(()).expect("broken");
        closed_by_client(&mut s)
    });
    let client = Client::connect(&path).expect("session");
    assert!(client.events_mapped());
    let f = rcm::Fabric::with_provider(Arc::new(client.clone()), rcm::FabricConfig::default());
    let ch = rcm::EventChannel::new();
    ch.set_spin(Duration::from_secs(2));
    let id = f.create_id_on(rcm::PortSpace::Tcp, &ch);
    // A call, so that the waiter polls this session (its busy-poll hint).
    id.set_reuseaddr(true).expect("reuseaddr");
    asleep.recv_timeout(T).expect("the reader sleeps");
    wait_until(rcm::spin_allowed, || {
        "this thread was held off polling for longer than a hold-off lasts (1.6 s)".into()
    });
    go_tx.send(()).expect("go");
    broken.recv_timeout(T).expect("the ring broken");
    let ev = ch.get_event(Some(Duration::from_secs(5)));
    assert!(!client.is_alive(), "the waiter did not see the broken ring");
    assert!(
        matches!(
            ev.as_ref().map(rcm::ChannelEvent::event),
            Some(rcm::Event::DeviceRemoval)
        ),
        "{:?}",
        ev.as_ref().map(|e| e.event().name())
    );
    drop(ev);
    assert!(
        fake.join().expect("the fake daemon"),
        "the session ended but its connection stayed open"
    );
    f.shutdown();
    let _ = std::fs::remove_file(&path);
}

/// The daemon rings for a reader asleep on the socket, and a waiter polling the session
/// reads that doorbell (the socket is read every 32 empty looks at the ring, by whoever
/// looks): the frame it announced must be taken then, or it waits in the ring, with the
/// reader asleep, until some later frame rings again. The window is a few instructions
/// wide; `strace` delay injection widens it to 100 ms (the waiter's `recvfrom` enters late)
/// and keeps the reader from its `poll` for 200 ms: the event is published in between.
/// Needs root and strace (`.ci/run` installs it; without them the test says so and passes
/// unless RCM_REQUIRE_ROOT is set).
#[test]
fn a_doorbell_read_by_a_polling_waiter_does_not_strand_its_frame() {
    let traced = std::process::Command::new("strace").arg("-V").output();
    if !traced.is_ok_and(|o| o.status.success()) {
        assert!(
            std::env::var_os("RCM_REQUIRE_ROOT").is_none(),
            "strace is needed (apt-get install strace)"
        );
        eprintln!("no strace: skipped");
        return;
    }
    let path = sock("ev-doorbell-waiter");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).expect("listen");
    let (cmd_tx, cmd_rx) = std::sync::mpsc::channel::<&'static str>();
    let (ack_tx, ack_rx) = std::sync::mpsc::channel::<()>();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("session");
        let (mut tx, region) = fake_mapped_session(&mut s, listener);
        answer_create_and_one_call(&mut tx, &mut s);
        ack_tx.send(()).expect("ack");
        let event = Message::Event {
            handle: proto::CLIENT_HANDLES,
            event: WireEvent::AddrResolved,
            qp: None,
        }
        .encode(0);
        while let Ok(c) = cmd_rx.recv() {
            match c {
                // A spurious doorbell (allowed: bytes read while not asleep are dropped):
                // the reader wakes, drains and sleeps again, its poll now delayed.
                "kick" => {
                    s.write_all(&[1]).expect("byte");
                    std::thread::sleep(Duration::from_millis(20));
                    wait_reader_asleep(&region);
                }
                "event" => push_ringing(&mut tx, &mut s, &event),
                "ring" => {
                    let _ = s.write_all(&[1]);
                }
                _ => break,
            }
            ack_tx.send(()).expect("ack");
        }
    });
    let client = Client::connect(&path).expect("session");
    assert!(client.events_mapped());
    let f = rcm::Fabric::with_provider(Arc::new(client.clone()), rcm::FabricConfig::default());
    let ch = rcm::EventChannel::new();
    ch.set_spin(Duration::from_millis(10));
    let id = f.create_id_on(rcm::PortSpace::Tcp, &ch);
    id.set_reuseaddr(true).expect("reuseaddr");
    ack_rx.recv_timeout(T).expect("answered");
    let me = thread_id("self").expect("this thread's id");
    let reader = thread_id("rcm-ucm-client").expect("the session's reader");
    let mut strace = std::process::Command::new("strace")
        .args(["-qq", "-o", "/dev/null", "-p"])
        .arg(me.to_string())
        .arg("-p")
        .arg(reader.to_string())
        .args([
            "-e",
            "trace=recvfrom,poll,ppoll",
            "-e",
            "inject=recvfrom:delay_enter=100000",
            "-e",
            "inject=poll,ppoll:delay_enter=200000",
        ])
        .spawn()
        .expect("strace");
    std::thread::sleep(Duration::from_secs(1));
    cmd_tx.send("kick").expect("kick");
    ack_rx.recv_timeout(T).expect("the reader sleeps again");
    // The event comes 20 ms into the waiter's poll: after its look at the ring, while its
    // socket read is held back.
    let late = {
        let cmd_tx = cmd_tx.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            cmd_tx.send("event").expect("event");
        })
    };
    let got = ch.get_event(Some(Duration::from_secs(2)));
    late.join().expect("the late event");
    ack_rx.recv_timeout(T).expect("published");
    // strace is this test's own child, ended by its handle.
    let _ = strace.kill();
    let _ = strace.wait();
    let stranded = got.is_none();
    drop(got);
    if stranded {
        // Show where it was: one more doorbell and the reader finds it.
        cmd_tx.send("ring").expect("ring");
        ack_rx.recv_timeout(T).expect("rung");
        let later = ch.get_event(Some(T));
        eprintln!(
            "after one more doorbell: {:?}",
            later.as_ref().map(|e| e.event().name())
        );
    }
    cmd_tx.send("stop").expect("stop");
    f.shutdown();
    let _ = fake.join();
    let _ = std::fs::remove_file(&path);
    assert!(
        !stranded,
        "the event was stranded in the ring behind a sleeping reader"
    );
}

/// The kernel's id of this thread (`"self"`) or of this process's thread named `name`.
fn thread_id(name: &str) -> Option<u32> {
    if name == "self" {
        return std::fs::read_link("/proc/thread-self")
            .ok()?
            .file_name()?
            .to_str()?
            .parse()
            .ok();
    }
    std::fs::read_dir("/proc/self/task").ok()?.find_map(|e| {
        let e = e.ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        (comm.trim() == name)
            .then(|| e.file_name().to_str()?.parse().ok())
            .flatten()
    })
}
