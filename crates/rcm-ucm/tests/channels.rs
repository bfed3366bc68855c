//! Command channels (protocol §2.1): extra connections attached to a session by its token,
//! on which a client's threads make their calls. The rules of `ATTACH`, what a channel may
//! and may not do, its limit, its life tied to the session's, and the client library's use
//! of channels (and its fallback when the daemon refuses them).

mod common;

use common::*;
use rcm::remote::{Limit, Op, Reply};
use rcm::{Event, EventChannel, PortSpace};
use rcm_ucm::proto::{self, Answer, Command, Limits, Message, WireError, WireEvent};
use rcm_ucm::raw::RawSession;
use rcm_ucm::{Daemon, MAX_CHANNELS};
use std::time::Duration;

fn attach_err(d: &Daemon, cmd: &Command) -> WireError {
    let mut c = RawSession::connect(d.socket()).expect("connect");
    err(&mut c, cmd)
}

#[test]
fn attach_rules() {
    let d = daemon("ch-rules", 47300, &[1]);
    let (mut a, ta) = raw(&d);
    // A token no session has, and a version range without ours.
    assert_eq!(
        attach_err(&d, &attach_cmd(ta ^ 1)),
        WireError::NoSuchSession
    );
    assert!(matches!(
        attach_err(
            &d,
            &Command::Attach {
                min: proto::VERSION + 1,
                max: proto::VERSION + 8,
                token: ta
            }
        ),
        WireError::Handshake(_)
    ));
    // Attach after Hello, and Hello or Attach on a channel: the session is already open.
    assert!(matches!(
        err(&mut a, &attach_cmd(ta)),
        WireError::Handshake(_)
    ));
    let mut c = channel(&d, ta);
    assert!(matches!(
        err(
            &mut c,
            &Command::Hello {
                min: proto::VERSION,
                max: proto::VERSION
            }
        ),
        WireError::Handshake(_)
    ));
    assert!(matches!(
        err(&mut c, &attach_cmd(ta)),
        WireError::Handshake(_)
    ));
    // Events flow on the session's connection only: GET_EVENT on a channel is answered
    // (unlike on a session) with an error, and grants nothing.
    assert!(matches!(
        err(&mut c, &Command::GetEvent(8)),
        WireError::BadMessage(_)
    ));
    assert_eq!(stats(&mut a).credit, 0);
    // A channel is not a session: counted apart, holding nothing. (The connections that
    // were refused above leave when the daemon's reader sees them closed: on a busy machine
    // that may come after this point.)
    wait_until(
        || d.sessions() == 1,
        || format!("{} sessions", d.sessions()),
    );
    assert_eq!(d.channels(), 1);
    // The same bad commands as on a session are refused the same way.
    assert_eq!(
        err(&mut c, &Command::Call(12345, Op::Query)),
        WireError::NoSuchId
    );
    drop(c);
    wait_until(
        || d.channels() == 0,
        || format!("{} channels", d.channels()),
    );
    assert_eq!(d.sessions(), 1);
}

#[test]
fn a_channel_acts_on_its_sessions_ids_and_events_come_on_the_session() {
    let d = daemon("ch-acts", 47301, &[1, 2]);
    let (mut a, ta) = raw(&d);
    let (mut b, _) = raw(&d);
    let mut c = channel(&d, ta);
    // Created on the channel, held by A: A's connection names it, B cannot.
    let h = create(&mut c);
    assert!(matches!(
        ok(&mut a, &Command::Call(h, Op::Query)),
        Answer::Reply(Reply::Info(_))
    ));
    assert_eq!(
        err(&mut b, &Command::Call(h, Op::Query)),
        WireError::NoSuchId
    );
    assert_eq!(stats(&mut a).ids, 1);
    assert_eq!(stats(&mut c).ids, 1, "Stats on a channel are its session's");
    // An operation on the channel; its event arrives on A's connection, never the channel.
    a.send(&Command::GetEvent(16)).expect("credit");
    ok(
        &mut c,
        &Command::Call(
            h,
            Op::ResolveAddr {
                src: None,
                dst: sa(2, 7000),
            },
        ),
    );
    match a.next_event().expect("event") {
        Message::Event { handle, event, .. } => {
            assert_eq!(handle, h);
            assert!(matches!(event, WireEvent::AddrResolved), "{event:?}");
        }
        m => panic!("{m:?}"),
    }
    assert_silent(&mut c, Duration::from_millis(200));
    // A created on A's connection, destroyed on the channel.
    let h2 = create(&mut a);
    ok(&mut c, &Command::DestroyId(h2));
    assert_eq!(
        err(&mut a, &Command::Call(h2, Op::Query)),
        WireError::NoSuchId
    );
    // Closing the channel leaves the session and its ids alone.
    drop(c);
    wait_until(
        || d.channels() == 0,
        || format!("{} channels", d.channels()),
    );
    assert!(matches!(
        ok(&mut a, &Command::Call(h, Op::Query)),
        Answer::Reply(Reply::Info(_))
    ));
    wait_ids(&d, 1, 1);
}

#[test]
fn channels_per_session_are_limited() {
    let d = daemon("ch-limit", 47302, &[1]);
    let (_a, ta) = raw(&d);
    let (_b, tb) = raw(&d);
    let mut open: Vec<RawSession> = (0..MAX_CHANNELS).map(|_| channel(&d, ta)).collect();
    assert_eq!(
        attach_err(&d, &attach_cmd(ta)),
        WireError::Cm(rcm::Error::LimitExceeded(Limit::Channels))
    );
    // The limit is per session: B still gets one.
    let _other = channel(&d, tb);
    // A channel that closes frees its place.
    open.pop();
    wait_until(
        || d.channels() == MAX_CHANNELS,
        || format!("{} channels", d.channels()),
    );
    open.push(channel(&d, ta));
    for c in &mut open {
        assert_eq!(stats(c).ids, 0);
    }
}

#[test]
fn channels_close_with_their_session() {
    let d = daemon("ch-close", 47303, &[1]);
    let (a, ta) = raw(&d);
    let mut c1 = channel(&d, ta);
    let mut c2 = channel(&d, ta);
    create(&mut c1);
    create(&mut c2);
    wait_ids(&d, 2, 2);
    // The session's connection goes: its ids are destroyed and its channels shut down.
    drop(a);
    wait_ids(&d, 0, 0);
    for c in [&mut c1, &mut c2] {
        match c.recv() {
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}"),
            Ok(m) => panic!("a channel of a closed session got {m:?}"),
        }
    }
    assert_eq!(d.channels(), 0);
    // And the token no longer attaches.
    assert_eq!(attach_err(&d, &attach_cmd(ta)), WireError::NoSuchSession);
}

/// `threads` threads at once each create, bind and destroy `each` ids on `f`, every call
/// checked; returns how many ids went through.
fn ids_from_threads(f: &rcm::Fabric, threads: usize, each: usize) -> usize {
    let made = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                for _ in 0..each {
                    let ch = EventChannel::new();
                    let id = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
                    id.bind(sa(2, 0)).expect("bind");
                    assert_eq!(id.state(), rcm::State::AddrBound);
                    id.destroy().expect("destroy");
                    made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
    });
    made.into_inner()
}

#[test]
fn the_client_library_calls_on_channels_from_many_threads() {
    let d = daemon("ch-client", 47304, &[1, 2]);
    let f = rcm_ucm::fabric(d.socket()).expect("client");
    // Eight threads at once, 50 ids each, every call checked.
    assert_eq!(ids_from_threads(&f, 8, 50), 8 * 50);
    let n = d.channels();
    assert!((1..=8).contains(&n), "{n} channels for 8 threads");
    wait_ids(&d, 0, 0);
    round_trip(&d, sa(1, 7304));
}

/// A session of `d` whose callbacks run on its reader (`CallbackMode::Inline`).
fn inline_session(d: &Daemon) -> rcm::Result<rcm::Fabric> {
    rcm_ucm::fabric_with(
        d.socket(),
        rcm::FabricConfig {
            callbacks: rcm::CallbackMode::Inline,
            ..rcm::FabricConfig::default()
        },
    )
}

/// More calling threads than channels, on a session whose callbacks run on its reader (so
/// a caller that finds every channel busy waits for one, rather than taking the session's
/// connection): each channel given back wakes one waiter, and every call still completes.
#[test]
fn more_calling_threads_than_channels_each_get_one_in_turn() {
    let mut cfg = config("ch-many-callers", 47313, &[1, 2]);
    cfg.max_channels = 2;
    let d = Daemon::start(cfg).expect("daemon");
    let f = inline_session(&d).expect("client");
    let made = within_a_minute(move || ids_from_threads(&f, 16, 30));
    assert_eq!(made, 16 * 30);
    assert!(d.channels() <= 2, "{} channels", d.channels());
    wait_ids(&d, 0, 0);
}

#[test]
fn a_destroy_is_done_when_it_returns() {
    // One id allowed: each create right after a blocking destroy must find the place free,
    // which holds only if the daemon carried the destroy out before the create.
    let d = daemon_with_limits(
        "ch-order",
        47305,
        &[1],
        Limits {
            max_ids: 1,
            ..Limits::default()
        },
    );
    let f = rcm_ucm::fabric(d.socket()).expect("client");
    for _ in 0..200 {
        let id = f
            .try_create_id_on(PortSpace::Tcp, &EventChannel::new())
            .expect("create at the limit after a destroy");
        id.destroy().expect("destroy");
    }
    assert!(matches!(
        f.try_create_id_on(PortSpace::Tcp, &EventChannel::new())
            .map(|_| ()),
        Ok(())
    ));
}

#[test]
fn without_channels_the_client_uses_the_session_connection() {
    let mut cfg = config("ch-none", 47306, &[1, 2]);
    cfg.max_channels = 0;
    let d = Daemon::start(cfg).expect("daemon");
    let f = rcm_ucm::fabric(d.socket()).expect("client");
    let ch = EventChannel::new();
    let id = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
    id.resolve_addr(None, sa(2, 7000)).expect("resolve");
    assert!(matches!(next(&ch).event(), Event::AddrResolved));
    assert_eq!(d.channels(), 0);
    id.destroy().expect("destroy");
    wait_ids(&d, 0, 0);
    round_trip(&d, sa(1, 7306));
}

#[test]
fn events_survive_a_full_socket_whole_once_and_in_order() {
    // The session grants credit for everything but reads nothing while a channel makes
    // 10,000 ids resolve their address and then their route: 20,000 events fill the socket
    // (cut batches go to the writer thread, others are sent from the callback thread), and
    // then every event must arrive whole, once, for the right id, and each id's two events
    // in the order they happened.
    const N: usize = 10_000;
    let d = daemon("ch-full", 47307, &[1, 2]);
    let (mut a, ta) = raw(&d);
    a.send(&Command::GetEvent(2 * N as u32)).expect("credit");
    let mut c = channel(&d, ta);
    let mut seen: std::collections::HashMap<u32, Vec<&'static str>> =
        std::collections::HashMap::new();
    for _ in 0..N {
        let h = create(&mut c);
        ok(
            &mut c,
            &Command::Call(
                h,
                Op::ResolveAddr {
                    src: None,
                    dst: sa(2, 7000),
                },
            ),
        );
        seen.insert(h, Vec::new());
    }
    let handles: Vec<u32> = seen.keys().copied().collect();
    for &h in &handles {
        // The route can be asked for once the address is resolved (the event is queued,
        // unread, by then or soon after).
        wait_until(
            || {
                matches!(
                    ok(&mut c, &Command::Call(h, Op::Query)),
                    Answer::Reply(Reply::Info(i)) if i.state == rcm::State::AddrResolved
                )
            },
            || format!("id {h} never reached AddrResolved"),
        );
        ok(&mut c, &Command::Call(h, Op::ResolveRoute));
    }
    for _ in 0..2 * N {
        match a.next_event().expect("event") {
            Message::Event { handle, event, .. } => {
                let name = match event {
                    WireEvent::AddrResolved => "addr",
                    WireEvent::RouteResolved => "route",
                    other => panic!("unexpected event {other:?} for {handle}"),
                };
                seen.get_mut(&handle)
                    .unwrap_or_else(|| panic!("event for unknown handle {handle}"))
                    .push(name);
            }
            m => panic!("{m:?}"),
        }
    }
    for (h, evs) in &seen {
        assert_eq!(evs, &["addr", "route"], "events of id {h}");
    }
    assert_eq!(stats(&mut a).dropped_events, 0);
}

/// Sets its flag when dropped.
struct Stop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for Stop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A server fabric whose callbacks run on its session's reader (`CallbackMode::Inline`) and
/// accept every request from there; `max_channels` command channels per session at the
/// daemon. Connects `n` clients while four threads of the server make calls on the same
/// session without pause, and returns the names of the threads the callbacks ran on.
fn inline_accepts_under_load(
    name: &str,
    port: u16,
    max_channels: usize,
    n: usize,
    shared_lock: bool,
) -> Vec<String> {
    use rcm::{AcceptOptions, Flow};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    // Patient retries: the callbacks wait for the application's lock, which a caller takes
    // over and over (std's Mutex is not fair: a callback starved for over a second and a
    // REQ given up after 1 s failed the test, 2 runs in 10; it tests for deadlock, not for
    // latency).
    let mut cfg = config_patient(name, port, &[1, 2]);
    cfg.max_channels = max_channels;
    let d = Daemon::start(cfg).expect("daemon");
    let server = inline_session(&d).expect("server");
    let client = rcm_ucm::fabric(d.socket()).expect("client");
    let names = Arc::new(Mutex::new(Vec::new()));
    let seen = names.clone();
    // With `shared_lock`, a fifth caller makes its calls holding a lock of the
    // application's that the callback takes too.
    let app = Arc::new(Mutex::new(()));
    let app_cb = app.clone();
    let l = server
        .try_create_id(PortSpace::Tcp, move |id, ev| {
            let t = std::thread::current().name().unwrap_or("?").to_string();
            seen.lock().expect("names").push(t);
            if let Event::ConnectRequest { .. } = ev {
                let _app = shared_lock.then(|| app_cb.lock().expect("app lock"));
                id.accept(&AcceptOptions::default())
                    .expect("accept from the callback");
            }
            Flow::Continue
        })
        .expect("listener");
    let addr = sa(1, port - 40000);
    l.bind(addr).expect("bind");
    l.listen(64).expect("listen");
    let stop = AtomicBool::new(false);
    // Three calls on the server's session, over and over, holding `lock` if given.
    let churn = |lock: Option<&Mutex<()>>| {
        while !stop.load(Ordering::SeqCst) {
            {
                let _app = lock.map(|m| m.lock().expect("app lock"));
                let id = server
                    .try_create_id_on(PortSpace::Tcp, &EventChannel::new())
                    .expect("create");
                id.bind(sa(1, 0)).expect("bind");
                id.destroy().expect("destroy");
            }
            if lock.is_some() {
                // A moment without the lock: re-taken at once, it is never the callback's.
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    };
    std::thread::scope(|s| {
        if shared_lock {
            s.spawn(|| churn(Some(&app)));
        }
        for _ in 0..4 {
            s.spawn(|| churn(None));
        }
        // Set however the connects end, so a failed one fails the test instead of leaving
        // the scope waiting for the callers.
        let _stop = Stop(&stop);
        for _ in 0..n {
            let ch = EventChannel::new();
            let c = dial(&client, &ch, addr, b"");
            let rep = next(&ch);
            assert!(
                matches!(rep.event(), Event::ConnectResponse { .. }),
                "{rep:?}"
            );
            drop(rep);
            c.establish().expect("establish");
            assert!(matches!(next(&ch).event(), Event::Established { .. }));
            c.destroy().expect("destroy");
        }
    });
    let n = names.lock().expect("names").clone();
    drop(l);
    n
}

#[test]
fn inline_callbacks_wait_for_a_busy_channel() {
    // One channel for the whole session, nearly always busy with the other threads' calls:
    // an accept from a callback on the reader must wait for it. Taking the session's
    // connection instead would wait for an answer that only the reader, itself, reads.
    let threads =
        within_a_minute(|| inline_accepts_under_load("ch-inline-busy", 47308, 1, 50, false));
    assert!(
        threads.iter().any(|t| t == "rcm-ucm-client"),
        "callbacks ran on {threads:?}"
    );
}

#[test]
fn inline_callbacks_without_channels_run_on_the_dispatcher() {
    // No channels at all: every answer comes on the session's connection, which the reader
    // reads, so callbacks must not run there.
    let threads =
        within_a_minute(|| inline_accepts_under_load("ch-inline-none", 47309, 0, 10, false));
    assert!(
        !threads.is_empty() && threads.iter().all(|t| t.starts_with("rcm-cb-")),
        "callbacks ran on {threads:?}"
    );
}

#[test]
fn inline_callbacks_and_callers_holding_their_lock_do_not_deadlock() {
    // Two channels kept busy by four callers, a fifth holding the application's lock over
    // each of its calls, and the callbacks on the reader taking that lock. A caller that found every channel busy used
    // to wait on the session's connection for an answer only the reader reads, while the
    // reader waited in a callback for the lock that caller held.
    let threads =
        within_a_minute(|| inline_accepts_under_load("ch-inline-lock", 47310, 2, 50, true));
    assert!(
        threads.iter().any(|t| t == "rcm-ucm-client"),
        "callbacks ran on {threads:?}"
    );
}

#[test]
fn a_fabric_shutdown_waits_for_the_callback_on_the_reader() {
    use rcm::{AcceptOptions, Flow};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let d = daemon("ch-inline-shutdown", 47311, &[1, 2]);
    let server = inline_session(&d).expect("server");
    let client = rcm_ucm::fabric(d.socket()).expect("client");
    let (started, done) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let (st, dn) = (started.clone(), done.clone());
    let l = server
        .try_create_id(PortSpace::Tcp, move |id, ev| {
            if let Event::ConnectRequest { .. } = ev {
                st.store(true, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(300));
                let _ = id.accept(&AcceptOptions::default());
                dn.store(true, Ordering::SeqCst);
            }
            Flow::Continue
        })
        .expect("listener");
    l.bind(sa(1, 7311)).expect("bind");
    l.listen(4).expect("listen");
    let ch = EventChannel::new();
    let _c = dial(&client, &ch, sa(1, 7311), b"");
    wait_until(
        || started.load(Ordering::SeqCst),
        || "the callback never started".into(),
    );
    // The callback runs on the session's reader: shutdown returns only once it is over.
    server.shutdown();
    assert!(
        done.load(Ordering::SeqCst),
        "shutdown returned with a callback still running"
    );
    client.shutdown();
}

#[test]
fn a_destroy_is_done_before_the_next_call_while_the_channels_are_busy() {
    // One channel, kept nearly always busy by another thread's queries; one id besides that
    // thread's. A destroy that finds the channel busy goes on the session's connection, and
    // the create that follows must still find the place it freed: a destroy sent there
    // without waiting could be overtaken by the create on the channel (LimitExceeded(Ids)).
    use std::sync::atomic::{AtomicBool, Ordering};
    let mut cfg = config("ch-destroy-busy", 47312, &[1]);
    cfg.max_channels = 1;
    cfg.limits = Limits {
        max_ids: 2,
        ..Limits::default()
    };
    let d = Daemon::start(cfg).expect("daemon");
    let f = rcm_ucm::fabric(d.socket()).expect("client");
    let busy = f
        .try_create_id_on(PortSpace::Tcp, &EventChannel::new())
        .expect("the querying thread's id");
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                let _ = busy.peer_addr();
            }
        });
        let _stop = Stop(&stop);
        for i in 0..2000 {
            let id = f
                .try_create_id_on(PortSpace::Tcp, &EventChannel::new())
                .unwrap_or_else(|e| panic!("create #{i} after a destroy: {e}"));
            id.destroy().expect("destroy");
        }
    });
}
