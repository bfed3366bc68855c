//! Several sessions and processes on one daemon: ownership, a client killed with SIGKILL,
//! limits, listeners with unread requests, Linux's ucma bugs 1 and 2, startup and shutdown,
//! losing the daemon, and the handshake.

mod common;

use common::*;
use rand::{Rng, SeedableRng};
use rcm::remote::{Limit, Op};
use rcm::{
    ConnectOptions, DestroyOutcome, Event, EventChannel, Fabric, FabricConfig, Flow, PortSpace,
    State,
};
use rcm_ucm::proto::{self, Answer, Command, Limits, Message, WireError, WireEvent};
use rcm_ucm::raw::RawSession;
use rcm_ucm::{Daemon, DaemonError};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command as Proc, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Barrier};
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "RCM_UCM_SESSIONS_CHILD";

fn limits(f: impl FnOnce(&mut Limits)) -> Limits {
    let mut l = Limits::default();
    f(&mut l);
    l
}

/// Every command that names a handle, aimed at `h`.
fn handle_commands(h: u32, token: u64) -> Vec<Command> {
    vec![
        Command::DestroyId(h),
        Command::MigrateId { token, handle: h },
        Command::Call(h, Op::SetReuseaddr(true)),
        Command::Call(h, Op::Bind(sa(1, 7000))),
        Command::BindOrSeal(h, sa(1, 7000)),
        Command::Call(
            h,
            Op::ResolveAddr {
                src: None,
                dst: sa(1, 7001),
            },
        ),
        Command::Call(h, Op::ResolveRoute),
        Command::Call(h, Op::Listen(4)),
        Command::Call(h, Op::CreateQp),
        Command::Call(h, Op::DestroyQp),
        Command::Call(h, Op::Connect(ConnectOptions::default())),
        Command::Call(h, Op::Accept(rcm::AcceptOptions::default())),
        Command::Call(h, Op::Reject(vec![1, 2, 3])),
        Command::Call(h, Op::Establish),
        Command::Call(h, Op::NotifyEstablished),
        Command::Call(h, Op::Disconnect),
        Command::Call(h, Op::InitQpAttr(rcm::QpState::Rtr)),
        Command::Call(h, Op::Query),
    ]
}

fn query(s: &mut RawSession, h: u32) -> rcm::remote::IdInfo {
    match ok(s, &Command::Call(h, Op::Query)) {
        Answer::Reply(rcm::remote::Reply::Info(i)) => i,
        a => panic!("Query answered {a:?}"),
    }
}

/// Migrates `handle` of the session with `token` into `s`: its new handle there.
fn migrate(s: &mut RawSession, token: u64, handle: u32) -> u32 {
    match ok(s, &Command::MigrateId { token, handle }) {
        Answer::Handle(h) => h,
        a => panic!("MIGRATE_ID of {handle} answered {a:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// a. Ownership

#[test]
fn another_sessions_handle_is_no_such_id() {
    let d = daemon("own", 47200, &[1]);
    let (mut a, ta) = raw(&d);
    let (mut b, tb) = raw(&d);
    let h = create(&mut a);
    // B holds nothing yet: A's handle, and handles that never existed, are all NoSuchId, and
    // the answers are byte-for-byte the same message.
    for target in [h, h + 1000, 0, u32::MAX] {
        for cmd in handle_commands(target, tb) {
            let m = b.call(&cmd).expect("reply");
            assert_eq!(m, Message::Err(WireError::NoSuchId), "B: {cmd:?}");
        }
    }
    // Naming A's token does not help B either for a handle A does not hold.
    assert_eq!(
        err(
            &mut b,
            &Command::MigrateId {
                token: ta,
                handle: h + 1000
            }
        ),
        WireError::NoSuchId
    );
    assert_eq!(
        err(
            &mut b,
            &Command::MigrateId {
                token: ta ^ 0x5a5a,
                handle: h
            }
        ),
        WireError::NoSuchSession
    );
    // A's id is untouched by all of that: still Idle, unbound, queryable by A.
    let info = query(&mut a, h);
    assert_eq!(info.state, State::Idle);
    assert_eq!(info.local, None);
    assert_eq!(stats(&mut a).ids, 1);
    assert_eq!(stats(&mut b).ids, 0);
    // B's own first id gets B's own handle namespace; A's id is still A's.
    let hb = create(&mut b);
    ok(&mut b, &Command::Call(hb, Op::Bind(sa(1, 7010))));
    assert_eq!(query(&mut a, h).local, None);
    ok(&mut a, &Command::Call(h, Op::Bind(sa(1, 7011))));
    assert_eq!(query(&mut a, h).local, Some(sa(1, 7011)));
    // A destroyed id: every command on its handle is NoSuchId, for A as for B.
    ok(&mut a, &Command::DestroyId(h));
    for cmd in handle_commands(h, ta) {
        let m = a.call(&cmd).expect("reply");
        assert_eq!(
            m,
            Message::Err(WireError::NoSuchId),
            "A after destroy: {cmd:?}"
        );
    }
    ok(&mut b, &Command::DestroyId(hb));
    wait_ids(&d, 0, 0);
}

// ---------------------------------------------------------------------------------------
// b. A client killed with SIGKILL

/// Not a test on its own: the child process's half of the kill -9 tests, run by
/// `spawn_child` (with `--ignored`, and `CHILD_ENV` naming what to do).
#[test]
#[ignore = "helper: run by the kill -9 tests in a child process"]
fn child_process() {
    let mode = std::env::var(CHILD_ENV).expect("run by spawn_child, with CHILD_ENV set");
    let path = std::env::var("RCM_UCM_CHILD_SOCK").expect("socket path");
    match mode.as_str() {
        "established" => {
            let f = rcm_ucm::fabric(&path).expect("child session");
            let (_l, _lch) = listen(&f, sa(1, 7101));
            let ch = EventChannel::new();
            let c = dial(&f, &ch, sa(1, 7100), b"child");
            let rep = next(&ch);
            assert!(
                matches!(rep.event(), Event::ConnectResponse { .. }),
                "{rep:?}"
            );
            drop(rep);
            c.establish().expect("establish");
            let e = next(&ch);
            assert!(matches!(e.event(), Event::Established { .. }), "{e:?}");
            drop(e);
            println!("READY");
            std::thread::sleep(Duration::from_secs(60));
            drop((c, f));
        }
        "unread" => {
            // A raw listener that never grants event credit: its requests stay unread.
            let (mut s, _) = RawSession::open(&path).expect("raw child");
            raw_listener(&mut s, sa(1, 7102), 16);
            println!("READY");
            std::thread::sleep(Duration::from_secs(60));
            drop(s);
        }
        m => panic!("unknown child mode {m}"),
    }
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts this test binary as the child in `mode`; returns it and a channel of its stdout.
fn spawn_child(d: &Daemon, mode: &str) -> (Killed, mpsc::Receiver<String>) {
    let child = Proc::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "child_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, mode)
        .env("RCM_UCM_CHILD_SOCK", d.socket())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child");
    let mut child = Killed(child);
    let out = child.0.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// Waits for the child's READY, which only the helper's body prints (the child is killed
/// while it runs, so libtest's "1 passed" never comes): it ran, and got where it says.
fn wait_ready(rx: &mpsc::Receiver<String>) {
    let t0 = Instant::now();
    let mut said = Vec::new();
    loop {
        let left = T.saturating_sub(t0.elapsed());
        match rx.recv_timeout(left) {
            // libtest prints "test child_process ... " on the same line first.
            Ok(l) if l.trim_end().ends_with("READY") => return,
            Ok(l) => said.push(l),
            Err(e) => panic!("child never said READY ({e}); it said: {said:?}"),
        }
    }
}

fn kill(mut child: Killed) {
    child.0.kill().expect("SIGKILL");
    let st = child.0.wait().expect("wait");
    assert!(!st.success(), "the child was killed: {st:?}");
}

/// Rejected or Unreachable; returns which (for the report).
fn refused(ev: &Event) -> &'static str {
    match ev {
        Event::Rejected { .. } => "Rejected",
        Event::Unreachable(_) => "Unreachable",
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn killed_client_is_cleaned_up_and_peers_see_it() {
    let d = daemon("kill9", 47201, &[1]);
    let parent = rcm_ucm::fabric(d.socket()).expect("parent session");
    let (l, lch) = listen(&parent, sa(1, 7100));
    let (child, out) = spawn_child(&d, "established");
    // The child dials us: accept, and wait for its READY (it saw Established).
    let conn = accept_next(&lch, b"parent");
    let e = next(&lch);
    assert!(matches!(e.event(), Event::Established { .. }), "{e:?}");
    drop(e);
    wait_ready(&out);
    // The parent holds 2 ids, the child 2 (its listener and its connection).
    assert_eq!(d.sessions(), 2);
    assert_eq!(d.held_ids(), 4);
    kill(child);

    // The daemon destroys the dead session's ids: its connection's DREQ reaches us.
    let e = next(&lch);
    assert_eq!(e.id(), &conn);
    assert!(matches!(e.event(), Event::Disconnected), "{e:?}");
    drop(e);
    wait_until(
        || d.sessions() == 1,
        || format!("{} sessions", d.sessions()),
    );
    // Nobody listens at the dead child's address any more.
    let cch = EventChannel::new();
    let c = dial(&parent, &cch, sa(1, 7101), b"anyone?");
    let e = next(&cch);
    let how = refused(e.event());
    eprintln!("connect to the killed client's listener: {how}");
    drop(e);
    assert_eq!(c.destroy(), Ok(DestroyOutcome::Done));
    // Only the parent's two ids are left, in the session table and in the fabric.
    wait_ids(&d, 2, 2);
    for id in [conn, l] {
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    wait_ids(&d, 0, 0);
    parent.shutdown();
}

#[test]
fn killed_client_with_unread_connect_requests() {
    let d = Daemon::start(config_patient("kill9unread", 47202, &[1])).expect("daemon");
    let parent = rcm_ucm::fabric(d.socket()).expect("parent session");
    let (child, out) = spawn_child(&d, "unread");
    wait_ready(&out);
    assert_eq!(d.held_ids(), 1);
    // Three requests reach the child's listener and wait there unread (no credit).
    let ch = EventChannel::new();
    let dials: Vec<_> = (0..3)
        .map(|i| dial(&parent, &ch, sa(1, 7102), &[i]))
        .collect();
    // 3 dialing ids + the child's listener + its 3 request children.
    wait_ids(&d, 7, 7);
    kill(child);
    let mut how = Vec::new();
    for _ in 0..3 {
        let e = next(&ch);
        assert!(dials.contains(e.id()));
        how.push(refused(e.event()));
    }
    eprintln!("dialers of the killed client's unread requests saw {how:?}");
    wait_until(
        || d.sessions() == 1,
        || format!("{} sessions", d.sessions()),
    );
    wait_ids(&d, 3, 3);
    for c in dials {
        assert_eq!(c.destroy(), Ok(DestroyOutcome::Done));
    }
    wait_ids(&d, 0, 0);
    parent.shutdown();
}

#[test]
fn a_client_may_name_the_handle_of_an_id_it_creates_in_its_own_range() {
    let d = daemon("client-handles", 47882, &[1]);
    let (mut a, _) = raw(&d);
    let (mut b, _) = raw(&d);
    let mine = proto::CLIENT_HANDLES + 7;
    assert!(matches!(
        ok(&mut a, &Command::CreateIdAs(PortSpace::Tcp, mine)),
        Answer::Handle(h) if h == mine
    ));
    // The id is there under that handle.
    ok(&mut a, &Command::Call(mine, Op::Bind(sa(1, 0))));
    // Held already, or below the client's range: refused, nothing created.
    for wrong in [mine, proto::CLIENT_HANDLES - 1, 1, 0] {
        assert!(
            matches!(
                err(&mut a, &Command::CreateIdAs(PortSpace::Tcp, wrong)),
                WireError::Cm(rcm::Error::InvalidArgument(_))
            ),
            "handle {wrong:#x}"
        );
    }
    assert_eq!(stats(&mut a).ids, 1);
    // Another session's handles are its own: the same number is free there.
    ok(&mut b, &Command::CreateIdAs(PortSpace::Tcp, mine));
    // The daemon's own choices stay below the range.
    let h = create(&mut a);
    assert!(h < proto::CLIENT_HANDLES, "{h:#x}");
    // Destroyed, the handle may be named again.
    ok(&mut a, &Command::DestroyId(mine));
    ok(&mut a, &Command::CreateIdAs(PortSpace::Udp, mine));
    assert_eq!(stats(&mut a).ids, 2);
}

#[test]
fn a_refused_bind_with_the_seal_flag_refuses_every_later_call_of_the_id_but_query() {
    let d = daemon("bind-seal", 47885, &[1]);
    let (mut a, ta) = raw(&d);
    let (mut b, _) = raw(&d);
    let holder = create(&mut a);
    ok(&mut a, &Command::Call(holder, Op::Bind(sa(1, 7495))));
    // Without the flag a refused bind changes nothing: the id binds elsewhere afterwards.
    let plain = create(&mut a);
    assert!(matches!(
        err(&mut a, &Command::Call(plain, Op::Bind(sa(1, 7495)))),
        WireError::Cm(rcm::Error::AddrInUse(_))
    ));
    ok(&mut a, &Command::Call(plain, Op::Bind(sa(1, 0))));
    // With it, one that succeeds is a bind like any.
    let good = create(&mut a);
    ok(&mut a, &Command::BindOrSeal(good, sa(1, 0)));
    ok(&mut a, &Command::Call(good, Op::Listen(0)));
    assert_eq!(query(&mut a, good).state, State::Listen);
    // Refused, it seals the id: what comes behind it is refused with the same error, where
    // a listen would otherwise have bound the wildcard address and a resolve_addr an
    // ephemeral port.
    for (port, nowhere) in [(7495, false), (0, true)] {
        let sealed = create(&mut a);
        let addr = if nowhere { sa(9, 0) } else { sa(1, port) };
        let e = err(&mut a, &Command::BindOrSeal(sealed, addr));
        if nowhere {
            assert_eq!(e, WireError::Cm(rcm::Error::AddrNotAvailable(ip(9))));
        } else {
            assert!(
                matches!(e, WireError::Cm(rcm::Error::AddrInUse(_))),
                "{e:?}"
            );
        }
        for cmd in handle_commands(sealed, 0).into_iter().filter(|c| {
            !matches!(
                c,
                Command::DestroyId(_) | Command::MigrateId { .. } | Command::Call(_, Op::Query)
            )
        }) {
            assert_eq!(err(&mut a, &cmd), e, "{cmd:?} on a sealed id");
        }
        // Nothing was carried out: the id is as created.
        assert_eq!(query(&mut a, sealed).state, State::Idle);
        if nowhere {
            // Migrated, it stays sealed; destroying it works there.
            let moved = migrate(&mut b, ta, sealed);
            assert_eq!(err(&mut b, &Command::Call(moved, Op::Bind(sa(1, 0)))), e);
            ok(&mut b, &Command::DestroyId(moved));
        } else {
            ok(&mut a, &Command::DestroyId(sealed));
        }
        assert_eq!(
            err(&mut a, &Command::Call(sealed, Op::Query)),
            WireError::NoSuchId
        );
    }
    // The port stayed the holder's all along.
    let probe = create(&mut a);
    assert!(matches!(
        err(&mut a, &Command::Call(probe, Op::Bind(sa(1, 7495)))),
        WireError::Cm(rcm::Error::AddrInUse(_))
    ));
    assert_eq!(stats(&mut a).ids, 4);
}

// ---------------------------------------------------------------------------------------
// c. Limits

#[test]
fn id_limit_is_typed_and_per_session() {
    let d = daemon_with_limits("lim-ids", 47203, &[1], limits(|l| l.max_ids = 3));
    let (mut a, _) = raw(&d);
    let (mut other, _) = raw(&d);
    let hs: Vec<u32> = (0..3).map(|_| create(&mut a)).collect();
    assert_eq!(
        err(&mut a, &Command::CreateId(PortSpace::Tcp)),
        WireError::Cm(rcm::Error::LimitExceeded(Limit::Ids))
    );
    assert_eq!(stats(&mut a).ids, 3);
    // Another session has its own allowance meanwhile.
    let ho = create(&mut other);
    assert!(matches!(ok(&mut other, &Command::Devices), Answer::Devices(v) if v == vec![ip(1)]));
    // Freeing one makes room again.
    ok(&mut a, &Command::DestroyId(hs[0]));
    let h4 = create(&mut a);
    assert!(!hs.contains(&h4), "handles are not reused");

    // Through the rcm API: the 4th try_create_id is Error::LimitExceeded(Limit::Ids).
    let f = rcm_ucm::fabric(d.socket()).expect("session");
    let ids: Vec<_> = (0..3)
        .map(|_| {
            f.try_create_id(PortSpace::Tcp, |_, _| Flow::Continue)
                .expect("within the limit")
        })
        .collect();
    assert_eq!(
        f.try_create_id(PortSpace::Tcp, |_, _| Flow::Continue).err(),
        Some(rcm::Error::LimitExceeded(Limit::Ids))
    );
    // create_id (no try_) gives an id that is already destroyed.
    let dead = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    assert_eq!(dead.state(), State::Destroying);
    for id in ids {
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    ok(&mut other, &Command::DestroyId(ho));
    drop((a, other));
    f.shutdown();
    wait_ids(&d, 0, 0);
}

#[test]
fn oversized_frame_is_refused_and_the_session_goes_on() {
    let max = 64u32;
    let d = daemon_with_limits("lim-msg", 47204, &[1], limits(|l| l.max_message = max));
    let (mut a, _) = raw(&d);
    let (mut other, _) = raw(&d);
    let h = create(&mut a);
    // A connect with 100 bytes of private data is a frame over 64 bytes.
    let big = Command::Call(
        h,
        Op::Connect(ConnectOptions {
            private_data: vec![7; 100],
            ..ConnectOptions::default()
        }),
    );
    assert!(big.encode(1).len() > max as usize);
    let seq = a.send(&big).expect("send");
    assert_eq!(
        a.wait_reply(seq).expect("reply"),
        Message::Err(WireError::Cm(rcm::Error::LimitExceeded(Limit::MessageSize)))
    );
    // Hand-made frames at the bound and one byte over it: a Stats frame padded with junk.
    let frame = |total: usize, seq: u32| {
        let mut f = Vec::with_capacity(total);
        f.extend_from_slice(&((total - 4) as u32).to_le_bytes());
        f.extend_from_slice(&proto::kind::STATS.to_le_bytes());
        f.extend_from_slice(&0u16.to_le_bytes());
        f.extend_from_slice(&seq.to_le_bytes());
        f.resize(total, 0xAB);
        f
    };
    a.send_bytes(&frame(max as usize + 1, 0x1111))
        .expect("send");
    a.send_bytes(&frame(max as usize, 0x2222)).expect("send");
    a.send_bytes(&frame(100_000, 0x3333)).expect("send");
    assert_eq!(
        a.wait_reply(0x1111).expect("reply"),
        Message::Err(WireError::Cm(rcm::Error::LimitExceeded(Limit::MessageSize)))
    );
    // Exactly max_message bytes is within the limit: decoded (and refused as malformed).
    assert!(matches!(
        a.wait_reply(0x2222).expect("reply"),
        Message::Err(WireError::BadMessage(_))
    ));
    assert_eq!(
        a.wait_reply(0x3333).expect("reply"),
        Message::Err(WireError::Cm(rcm::Error::LimitExceeded(Limit::MessageSize)))
    );
    // The session still works, and the id is untouched.
    assert_eq!(query(&mut a, h).state, State::Idle);
    assert_eq!(stats(&mut other).ids, 0);
    ok(&mut a, &Command::DestroyId(h));
    wait_ids(&d, 0, 0);
}

#[test]
fn unread_request_limit_refuses_on_the_wire() {
    let mut cfg = config_patient("lim-unread", 47205, &[1]);
    cfg.limits = limits(|l| l.max_unread_requests = 2);
    let d = Daemon::start(cfg).expect("daemon");
    // A raw listener that grants no event credit.
    let (mut ls, _) = raw(&d);
    let lh = raw_listener(&mut ls, sa(1, 7200), 16);
    let peer = rcm_ucm::fabric(d.socket()).expect("peer");
    let ch = EventChannel::new();
    let c1 = dial(&peer, &ch, sa(1, 7200), &[1]);
    wait_stats(&mut ls, |s| s.queued_events == 1, "the 1st request");
    let c2 = dial(&peer, &ch, sa(1, 7200), &[2]);
    wait_stats(&mut ls, |s| s.queued_events == 2, "the 2nd request");
    let c3 = dial(&peer, &ch, sa(1, 7200), &[3]);
    let e = next(&ch);
    assert_eq!(e.id(), &c3);
    assert!(matches!(e.event(), Event::Rejected { .. }), "{e:?}");
    drop(e);
    let st = stats(&mut ls);
    assert_eq!(st.refused_requests, 1);
    assert_eq!(st.queued_events, 2);
    assert_eq!(st.ids, 3, "the listener and two children");
    // The peer session is served meanwhile.
    assert_eq!(peer.device_addrs(), vec![ip(1)]);
    // With credit, exactly the two queued requests arrive, in order, naming the listener.
    ls.send(&Command::GetEvent(10)).expect("send");
    for want in [1u8, 2] {
        match ls.next_event().expect("event") {
            Message::Event {
                event:
                    WireEvent::ConnectRequest {
                        listener,
                        private_data,
                        ..
                    },
                ..
            } => {
                assert_eq!(listener, lh);
                assert_eq!(private_data[0], want);
            }
            m => panic!("expected a connect request, got {m:?}"),
        }
    }
    assert_silent(&mut ls, Duration::from_millis(200));
    drop(ls);
    for c in [c1, c2, c3] {
        assert_eq!(c.destroy(), Ok(DestroyOutcome::Done));
    }
    peer.shutdown();
    wait_ids(&d, 0, 0);
}

/// With the default limits, a listener's client that reads more slowly than a burst of
/// requests comes has them queued, not rejected, while its backlog allows them: here it
/// reads nothing, and 4,200 requests (more than one credit window of 4,096) wait for it.
#[test]
fn a_burst_past_a_credit_window_waits_for_a_slow_listener() {
    const N: usize = 4200;
    let port = 47229;
    let d = Daemon::start(config_patient("burst-unread", port, &[1])).expect("daemon");
    let (mut ls, _) = raw(&d);
    raw_listener(&mut ls, sa(1, 7200), N);
    // The peer is in-process (its own device on 127.0.0.2), so the burst is quick to make.
    let peer = Fabric::new(FabricConfig {
        udp_port: port,
        ..config_patient("burst-unread-peer", port, &[]).fabric
    });
    peer.add_device(ip(2)).expect("peer device");
    let ch = EventChannel::new();
    let ids: Vec<_> = (0..N)
        .map(|_| {
            let c = peer.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
            c.resolve_addr(None, sa(1, 7200)).expect("resolve_addr");
            c
        })
        .collect();
    let mut connected = 0;
    while connected < N {
        let e = next(&ch);
        match e.event() {
            Event::AddrResolved => e.id().resolve_route().expect("resolve_route"),
            Event::RouteResolved => {
                e.id().connect(&ConnectOptions::default()).expect("connect");
                connected += 1;
            }
            ev => panic!("unexpected {ev:?}"),
        }
    }
    wait_stats(
        &mut ls,
        |s| s.queued_events == N as u64 || s.refused_requests > 0,
        "every request queued",
    );
    let st = stats(&mut ls);
    assert_eq!(st.refused_requests, 0, "{st:?}");
    assert_eq!(st.queued_events, N as u64);
    assert!(
        ch.get_event(Some(Duration::ZERO)).is_none(),
        "no peer saw a reject"
    );
    drop(ls);
    for c in ids {
        let _ = c.destroy();
    }
    peer.shutdown();
}

/// `DESTROY_ID` answers how many events the session had been written when the handle went
/// (protocol §8): an event written before counts, one still queued for want of credit does
/// not (it goes with the id), and neither do events written after.
#[test]
fn destroy_answers_how_many_events_were_written_before_the_handle_went() {
    let d = daemon("released", 47887, &[1]);
    let (mut s, _) = raw(&d);
    let resolve = |h| {
        Command::Call(
            h,
            Op::ResolveAddr {
                src: None,
                dst: nowhere(),
            },
        )
    };
    let released = |s: &mut RawSession, h| match ok(s, &Command::DestroyId(h)) {
        Answer::Released { events } => events,
        a => panic!("DestroyId answered {a:?}"),
    };
    let event_of = |s: &mut RawSession, want: u32| match s.next_event().expect("event") {
        Message::Event { handle, .. } => assert_eq!(handle, want),
        m => panic!("expected an event, got {m:?}"),
    };
    let (a, b, c) = (create(&mut s), create(&mut s), create(&mut s));
    s.send(&Command::GetEvent(2)).expect("credit");
    ok(&mut s, &resolve(a));
    event_of(&mut s, a);
    ok(&mut s, &resolve(b));
    event_of(&mut s, b);
    // c's event waits for credit: not written, so not counted, and it goes with c.
    ok(&mut s, &resolve(c));
    wait_stats(&mut s, |st| st.queued_events == 1, "c's event queued");
    assert_eq!(released(&mut s, c), 2);
    assert_eq!(stats(&mut s).queued_events, 0, "c's event went with c");
    // b's event, written after a's, counts for a too.
    assert_eq!(released(&mut s, a), 2);
    // An id that had no event: the count when it went.
    let e = create(&mut s);
    s.send(&Command::GetEvent(1)).expect("credit");
    ok(&mut s, &resolve(b));
    event_of(&mut s, b);
    assert_eq!(released(&mut s, e), 3);
    assert_eq!(released(&mut s, b), 3);
    assert!(matches!(
        err(&mut s, &Command::DestroyId(b)),
        WireError::NoSuchId
    ));
    drop(s);
    wait_ids(&d, 0, 0);
}

/// Credit for more events than one batch (256) brings them all: after a whole batch went
/// out, the rest waited (with credit) for the next event to be queued.
#[test]
fn credit_for_more_than_a_batch_brings_every_queued_event() {
    const N: usize = 600;
    let d = daemon("credit-batches", 47224, &[1]);
    let (mut s, _) = raw(&d);
    for _ in 0..N {
        let h = create(&mut s);
        ok(
            &mut s,
            &Command::Call(
                h,
                Op::ResolveAddr {
                    src: None,
                    dst: nowhere(),
                },
            ),
        );
    }
    wait_stats(
        &mut s,
        |st| st.queued_events == N as u64,
        "every event queued",
    );
    s.send(&Command::GetEvent(N as u32)).expect("send");
    for k in 0..N {
        match s.next_event() {
            Ok(Message::Event { .. }) => {}
            other => panic!("event {k} of {N}: {other:?}"),
        }
    }
    drop(s);
    wait_ids(&d, 0, 0);
}

#[test]
fn queued_event_limit_drops_and_counts() {
    let d = daemon_with_limits(
        "lim-events",
        47206,
        &[1],
        limits(|l| l.max_queued_events = 3),
    );
    let (mut s, _) = raw(&d);
    let (mut other, _) = raw(&d);
    let hs: Vec<u32> = (0..3).map(|_| create(&mut s)).collect();
    let resolve = |h| {
        Command::Call(
            h,
            Op::ResolveAddr {
                src: None,
                dst: nowhere(),
            },
        )
    };
    // One AddrError per call, queued in this order: h0, h1, h2; then two more are dropped.
    for (i, h) in hs.iter().enumerate() {
        ok(&mut s, &resolve(*h));
        wait_stats(&mut s, |st| st.queued_events == i as u64 + 1, "an event");
    }
    for (i, h) in hs.iter().take(2).enumerate() {
        ok(&mut s, &resolve(*h));
        wait_stats(&mut s, |st| st.dropped_events == i as u64 + 1, "a drop");
    }
    let st = stats(&mut s);
    assert_eq!((st.queued_events, st.dropped_events, st.credit), (3, 2, 0));
    assert_eq!(d.dropped_events(), 2);
    // Another session is served meanwhile.
    create(&mut other);
    s.send(&Command::GetEvent(100)).expect("send");
    for h in &hs {
        match s.next_event().expect("event") {
            Message::Event {
                handle,
                event: WireEvent::AddrError(_),
                ..
            } => assert_eq!(handle, *h),
            m => panic!("expected AddrError, got {m:?}"),
        }
    }
    assert_silent(&mut s, Duration::from_millis(200));
    let st = stats(&mut s);
    assert_eq!((st.queued_events, st.credit), (0, 97));
    // The ids are still usable: a new event after the drops is delivered.
    ok(&mut s, &resolve(hs[2]));
    assert!(matches!(
        s.next_event().expect("event"),
        Message::Event { handle, event: WireEvent::AddrError(_), .. } if handle == hs[2]
    ));
    drop((s, other));
    wait_ids(&d, 0, 0);
}

// ---------------------------------------------------------------------------------------
// d. Destroying a listener with unread requests

#[test]
fn destroying_a_listener_with_unread_requests_rejects_them() {
    let d = Daemon::start(config_patient("unread", 47207, &[1])).expect("daemon");
    let (mut ls, _) = raw(&d);
    let lh = raw_listener(&mut ls, sa(1, 7300), 16);
    let peer = rcm_ucm::fabric(d.socket()).expect("peer");
    let ch = EventChannel::new();
    let dials: Vec<_> = (0..4)
        .map(|i| dial(&peer, &ch, sa(1, 7300), &[i]))
        .collect();
    wait_stats(&mut ls, |s| s.queued_events == 4, "4 unread requests");
    assert_eq!(stats(&mut ls).ids, 5);
    ok(&mut ls, &Command::DestroyId(lh));
    let st = stats(&mut ls);
    assert_eq!((st.ids, st.queued_events), (0, 0), "{st:?}");
    for _ in 0..4 {
        let e = next(&ch);
        assert!(dials.contains(e.id()));
        assert!(matches!(e.event(), Event::Rejected { .. }), "{e:?}");
    }
    // Nothing of the destroyed listener or its children is delivered later.
    ls.send(&Command::GetEvent(10)).expect("send");
    assert_silent(&mut ls, Duration::from_millis(200));
    // Only the peer's dialing ids are left.
    wait_ids(&d, 4, 4);
    for c in dials {
        assert_eq!(c.destroy(), Ok(DestroyOutcome::Done));
    }
    wait_ids(&d, 0, 0);
    peer.shutdown();
}

// ---------------------------------------------------------------------------------------
// e. Linux bug 1: migrate vs destroy vs close

#[test]
fn migrate_racing_destroy_and_close() {
    let d = daemon("bug1", 47208, &[1]);
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xB0C1);
    let (mut wins, mut migrated, mut destroyed) = (0, 0, 0);
    for i in 0..200 {
        let (mut a, ta) = raw(&d);
        let (mut b, _) = raw(&d);
        a.set_timeout(Duration::from_secs(5)).expect("timeout");
        b.set_timeout(Duration::from_secs(5)).expect("timeout");
        let h = create(&mut a);
        for _ in 0..rng.gen_range(0..3) {
            ok(
                &mut a,
                &Command::Call(
                    h,
                    Op::ResolveAddr {
                        src: None,
                        dst: nowhere(),
                    },
                ),
            );
        }
        // 0: both replies read; 1: A closes right after its destroy; 2: B right after its
        // migrate.
        let close = rng.gen_range(0..3u8);
        let go = Arc::new(Barrier::new(2));
        let g = go.clone();
        let tb = std::thread::spawn(move || {
            g.wait();
            let seq = b
                .send(&Command::MigrateId {
                    token: ta,
                    handle: h,
                })
                .expect("send");
            if close == 2 {
                drop(b);
                return None;
            }
            Some((b.wait_reply(seq).expect("migrate reply (no hang)"), b))
        });
        go.wait();
        let seq = a.send(&Command::DestroyId(h)).expect("send");
        let ra = if close == 1 {
            drop(a);
            None
        } else {
            Some(a.wait_reply(seq).expect("destroy reply (no hang)"))
        };
        let rb = tb.join().expect("migrating thread");
        let a_ok = ra.as_ref().map(|m| match m {
            Message::Ok(_) => true,
            Message::Err(WireError::NoSuchId) => false,
            m => panic!("iteration {i}: destroy answered {m:?}"),
        });
        let b_ok = rb.as_ref().map(|(m, _)| match m {
            Message::Ok(Answer::Handle(_)) => true,
            Message::Err(WireError::NoSuchId) => false,
            // A may be gone entirely (closed) before the migrate is looked at.
            Message::Err(WireError::NoSuchSession) if close == 1 => false,
            m => panic!("iteration {i}: migrate answered {m:?}"),
        });
        if let (Some(x), Some(y)) = (a_ok, b_ok) {
            assert!(x ^ y, "iteration {i}: destroy ok={x}, migrate ok={y}");
            wins += 1;
        }
        if let Some((m, mut b)) = rb {
            let held = stats(&mut b).ids;
            if let Message::Ok(Answer::Handle(nh)) = m {
                migrated += 1;
                assert_eq!(held, 1, "iteration {i}");
                assert_eq!(query(&mut b, nh).state, State::Idle);
            } else {
                destroyed += 1;
                assert_eq!(held, 0, "iteration {i}");
            }
        }
    }
    eprintln!("{wins} decided races: {migrated} migrated, {destroyed} destroyed first");
    wait_until(
        || d.sessions() == 0,
        || format!("{} sessions", d.sessions()),
    );
    wait_ids(&d, 0, 0);
}

#[test]
fn migrate_moves_queued_events_in_order() {
    let d = daemon("migrate", 47209, &[1]);
    let (mut a, ta) = raw(&d);
    let (mut b, _) = raw(&d);
    let keep = create(&mut a);
    let h = create(&mut a);
    // B already holds an id, so the migrated one gets a new handle there.
    let hb0 = create(&mut b);
    let resolve = |h, port| {
        Command::Call(
            h,
            Op::ResolveAddr {
                src: Some(ip(1)),
                dst: SocketAddr::new(nowhere().ip(), port),
            },
        )
    };
    // Queued for A (no credit): h, keep, h, h — one at a time so the order is known.
    for (n, id) in [h, keep, h, h].into_iter().enumerate() {
        ok(&mut a, &resolve(id, n as u16 + 1));
        wait_stats(&mut a, |s| s.queued_events == n as u64 + 1, "an event");
    }
    let nh = migrate(&mut b, ta, h);
    assert_ne!(nh, hb0);
    assert_eq!(stats(&mut a).queued_events, 1, "only `keep`'s event stays");
    assert_eq!(stats(&mut b).queued_events, 3);
    // The old handle is gone from A; the id answers in B.
    assert_eq!(
        err(&mut a, &Command::Call(h, Op::Query)),
        WireError::NoSuchId
    );
    assert_eq!(query(&mut b, nh).state, State::Idle);
    b.send(&Command::GetEvent(10)).expect("send");
    for _ in 0..3 {
        match b.next_event().expect("event") {
            Message::Event {
                handle,
                event: WireEvent::AddrError(_),
                ..
            } => assert_eq!(handle, nh),
            m => panic!("expected AddrError on the new handle, got {m:?}"),
        }
    }
    assert_silent(&mut b, Duration::from_millis(100));
    // New events of the id go to B too.
    ok(&mut b, &resolve(nh, 9));
    assert!(matches!(
        b.next_event().expect("event"),
        Message::Event { handle, event: WireEvent::AddrError(_), .. } if handle == nh
    ));
    a.send(&Command::GetEvent(10)).expect("send");
    assert!(matches!(
        a.next_event().expect("event"),
        Message::Event { handle, .. } if handle == keep
    ));
    assert_silent(&mut a, Duration::from_millis(100));
    drop((a, b));
    wait_ids(&d, 0, 0);
}

/// Two raw sessions of a daemon, A with a listener on port `lport` and one connect request
/// queued for it, unread (A has no event credit), and the client id that sent it.
struct QueuedRequest {
    d: Daemon,
    a: RawSession,
    ta: u64,
    b: RawSession,
    l: u32,
    /// The request's child: handles are handed out in order, so it is the listener's next.
    child: u32,
    /// The client's fabric: dropped, it would destroy `c`.
    _client: rcm::Fabric,
    cch: EventChannel,
    c: rcm::CmId,
}

fn queued_request(name: &str, port: u16, lport: u16, pd: &[u8]) -> QueuedRequest {
    let d = daemon(name, port, &[1]);
    let (mut a, ta) = raw(&d);
    let (b, _) = raw(&d);
    let l = raw_listener(&mut a, sa(1, lport), 4);
    let client = rcm_ucm::fabric(d.socket()).expect("client");
    let cch = EventChannel::new();
    let c = dial(&client, &cch, sa(1, lport), pd);
    wait_stats(&mut a, |s| s.queued_events == 1, "the connect request");
    QueuedRequest {
        d,
        a,
        ta,
        b,
        l,
        child: l + 1,
        _client: client,
        cch,
        c,
    }
}

/// A child whose connect request is still queued (its client was never told its handle) does
/// not migrate: the request names the listener by its handle in the source session. Once
/// the request is written, the child is an id like any other and migrates.
#[test]
fn a_child_with_its_request_still_queued_does_not_migrate() {
    // A has no event credit: the request waits in its queue; B guesses the child's handle.
    let QueuedRequest {
        d,
        mut a,
        ta,
        mut b,
        l,
        child,
        c,
        _client,
        cch: _cch,
    } = queued_request("migchild", 47219, 7600, b"queued");
    let unread = Command::MigrateId {
        token: ta,
        handle: child,
    };
    assert_eq!(err(&mut b, &unread), WireError::NoSuchId);
    a.send(&Command::GetEvent(10)).expect("send");
    match a.next_event().expect("event") {
        Message::Event {
            handle,
            event: WireEvent::ConnectRequest { listener, .. },
            ..
        } => assert_eq!((handle, listener), (child, l)),
        m => panic!("expected the connect request, got {m:?}"),
    }
    let nh = migrate(&mut b, ta, child);
    assert_eq!(query(&mut b, nh).state, State::Connect);
    assert_eq!(c.destroy(), Ok(DestroyOutcome::Done));
    drop((a, b));
    wait_ids(&d, 0, 0);
}

/// A listener migrates with the connect requests still queued for it (Linux's
/// `ucma_move_events`): their children go too, under new handles, and the requests reach
/// the destination naming the listener's new handle; the source is told nothing, and the
/// destination can accept the request, establishing the peer's connection.
#[test]
fn a_listener_migrates_with_its_queued_requests() {
    let d = daemon("miglistener", 47220, &[1]);
    let (mut a, ta) = raw(&d);
    let (mut b, _) = raw(&d);
    let l = raw_listener(&mut a, sa(1, 7601), 4);
    let client = rcm_ucm::fabric(d.socket()).expect("client");
    let cch = EventChannel::new();
    let c1 = dial(&client, &cch, sa(1, 7601), b"first");
    wait_stats(&mut a, |s| s.queued_events == 1, "the first request");
    let c2 = dial(&client, &cch, sa(1, 7601), b"second");
    wait_stats(&mut a, |s| s.queued_events == 2, "the second request");
    let held = create(&mut b);
    let nl = migrate(&mut b, ta, l);
    assert_eq!(
        stats(&mut a).queued_events,
        0,
        "the requests left the source"
    );
    assert_eq!(stats(&mut a).ids, 0, "and their children with them");
    assert_eq!(
        stats(&mut b).ids,
        4,
        "B: its own id, the listener, two children"
    );
    b.send(&Command::GetEvent(10)).expect("send");
    let mut children = Vec::new();
    for want in [&b"first"[..], &b"second"[..]] {
        match b.next_event().expect("event") {
            Message::Event {
                handle,
                event:
                    WireEvent::ConnectRequest {
                        listener,
                        private_data,
                        ..
                    },
                ..
            } => {
                assert_eq!(listener, nl, "names the listener's new handle");
                assert!(private_data.starts_with(want), "in their order");
                assert!(handle != held && handle != nl);
                children.push(handle);
            }
            m => panic!("expected a connect request, got {m:?}"),
        }
    }
    assert_silent(&mut a, Duration::from_millis(200));
    for h in &children {
        assert_eq!(query(&mut b, *h).state, State::Connect);
    }
    ok(
        &mut b,
        &Command::Call(children[0], Op::Accept(rcm::AcceptOptions::default())),
    );
    loop {
        let e = next(&cch);
        if e.id() == &c1 {
            if let Event::ConnectResponse { .. } = e.event() {
                c1.establish().expect("establish");
                break;
            }
        }
    }
    wait_until(
        || c1.state() == State::Established,
        || format!("{:?}", c1.state()),
    );
    for id in [c1, c2] {
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    drop((a, b));
    wait_ids(&d, 0, 0);
}

#[test]
fn a_sealed_child_that_migrates_with_its_listener_stays_sealed() {
    // A's client has not read the request, but the child's handle can be guessed.
    let QueuedRequest {
        d,
        mut a,
        ta,
        mut b,
        l,
        child,
        cch,
        c,
        _client,
    } = queued_request("sealed-child", 47886, 7602, b"sealed");
    assert_eq!(query(&mut a, child).state, State::Connect);
    // A bound child refuses a bind; with the seal flag that seals it.
    let e = err(&mut a, &Command::BindOrSeal(child, sa(1, 0)));
    let accept = Command::Call(child, Op::Accept(rcm::AcceptOptions::default()));
    assert_eq!(err(&mut a, &accept), e);
    // B has no sealed id of its own: only the child's move can tell B's table to look.
    let nl = migrate(&mut b, ta, l);
    b.send(&Command::GetEvent(10)).expect("send");
    let moved = match b.next_event().expect("event") {
        Message::Event {
            handle,
            event: WireEvent::ConnectRequest { listener, .. },
            ..
        } => {
            assert_eq!(listener, nl);
            handle
        }
        m => panic!("expected the connect request, got {m:?}"),
    };
    assert_eq!(query(&mut b, moved).state, State::Connect);
    assert_eq!(
        err(
            &mut b,
            &Command::Call(moved, Op::Accept(rcm::AcceptOptions::default()))
        ),
        e,
        "the child stayed sealed in its new session"
    );
    ok(&mut b, &Command::DestroyId(moved));
    // Destroyed, the child rejects the request.
    loop {
        let ev = next(&cch);
        if ev.id() == &c {
            assert!(matches!(ev.event(), Event::Rejected { .. }), "{ev:?}");
            break;
        }
    }
    assert_eq!(c.destroy(), Ok(DestroyOutcome::Done));
    drop((a, b));
    wait_ids(&d, 0, 0);
}

// ---------------------------------------------------------------------------------------
// f. Linux bug 2: concurrent commands on one id

#[test]
fn concurrent_commands_on_one_id() {
    let d = daemon("bug2", 47210, &[1]);
    let server = rcm_ucm::fabric(d.socket()).expect("server");
    let f = rcm_ucm::fabric(d.socket()).expect("hammer session");
    // A listener that accepts everything, so connects can get somewhere.
    let l = server
        .try_create_id(PortSpace::Tcp, |id, ev| match ev {
            Event::ConnectRequest { .. } => {
                let _ = id.accept(&rcm::AcceptOptions::default());
                Flow::Continue
            }
            Event::Disconnected => Flow::Destroy,
            _ => Flow::Continue,
        })
        .expect("listener");
    l.bind(sa(1, 7400)).expect("bind");
    l.listen(64).expect("listen");
    let events = Arc::new(AtomicUsize::new(0));
    let ev2 = events.clone();
    let id = f
        .try_create_id(PortSpace::Tcp, move |id, ev| {
            ev2.fetch_add(1, Ordering::Relaxed);
            if matches!(ev, Event::ConnectResponse { .. }) {
                let _ = id.establish();
            }
            Flow::Continue
        })
        .expect("id");
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let id = id.clone();
            let stop = stop.clone();
            let calls = calls.clone();
            std::thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(0xB0C2 + t);
                while !stop.load(Ordering::Relaxed) {
                    let r = match rng.gen_range(0..9) {
                        0 => id.bind(sa(1, rng.gen_range(7401..7405))),
                        1 => id.resolve_addr(None, sa(1, 7400)),
                        2 => id.resolve_route(),
                        3 => id.listen(4),
                        4 => id.connect(&ConnectOptions::default()),
                        5 => {
                            let _ = id.state();
                            Ok(())
                        }
                        6 => id.disconnect(),
                        7 => id.set_reuseaddr(rng.gen()),
                        _ => id.init_qp_attr(rcm::QpState::Init).map(drop),
                    };
                    calls.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = r {
                        assert!(
                            !matches!(
                                e,
                                rcm::Error::Remote(_)
                                    | rcm::Error::DeviceRemoved
                                    | rcm::Error::Destroyed
                                    | rcm::Error::LimitExceeded(_)
                            ),
                            "untyped or unexpected error: {e:?}"
                        );
                    }
                }
            })
        })
        .collect();
    // The daemon keeps answering another session promptly meanwhile.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(1) {
        let t = Instant::now();
        assert_eq!(server.device_addrs(), vec![ip(1)]);
        assert!(t.elapsed() < Duration::from_secs(2));
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().expect("no panic in a hammering thread");
    }
    eprintln!(
        "{} calls, {} events on the hammered id",
        calls.load(Ordering::Relaxed),
        events.load(Ordering::Relaxed)
    );
    assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    assert_eq!(id.state(), State::Destroying);
    assert_eq!(l.destroy(), Ok(DestroyOutcome::Done));
    // Children the listener accepted end by Flow::Destroy on Disconnected (the hammered id's
    // destroy sends the DREQ) or with the server session.
    server.shutdown();
    f.shutdown();
    wait_ids(&d, 0, 0);
    round_trip(&d, sa(1, 7410));
    wait_ids(&d, 0, 0);
}

// ---------------------------------------------------------------------------------------
// g. Two clients through one device

#[test]
fn two_clients_connect_through_one_device() {
    let d = daemon("onedev", 47211, &[1]);
    let server = rcm_ucm::fabric(d.socket()).expect("server");
    let client = rcm_ucm::fabric(d.socket()).expect("client");
    assert_eq!(client.device_addrs(), vec![ip(1)]);
    let (l, sch) = listen(&server, sa(1, 7500));
    let cch = EventChannel::new();
    let c = dial(&client, &cch, sa(1, 7500), b"same device");
    assert_eq!(c.device_addr(), Some(ip(1)));
    let child = accept_next(&sch, b"ok");
    finish_connect(&c, &cch, &sch);
    assert_eq!(c.state(), State::Established);
    assert_eq!(child.state(), State::Established);
    assert_eq!(child.local_addr(), Some(sa(1, 7500)));
    assert_eq!(child.peer_addr(), c.local_addr());
    assert_eq!(c.peer_addr(), Some(sa(1, 7500)));
    assert_eq!(c.local_addr().map(|a| a.ip()), Some(ip(1)));
    child.disconnect().expect("disconnect");
    let e = next(&sch);
    assert!(matches!(e.event(), Event::Disconnected), "{e:?}");
    drop(e);
    let e = next(&cch);
    assert!(matches!(e.event(), Event::Disconnected), "{e:?}");
    drop(e);
    for id in [c, child, l] {
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    wait_ids(&d, 0, 0);
    // The device talked to itself: its datagrams went straight to its engine, none
    // through UDP (rcm::FabricConfig::loopback).
    let dev = d.fabric().device(ip(1)).expect("the daemon's device");
    let (_, sent) = dev.traffic();
    assert!(dev.looped() >= 5, "{} looped", dev.looped());
    assert_eq!(dev.looped(), sent);
}

/// The events a call produces at once are queued, and written as far as credit allows,
/// before its answer: a peer waits for them, the answer only unblocks the caller
/// (docs/ucm-protocol.md, credit). On the session's own connection a RESOLVE_ADDR's
/// ADDR_RESOLVED comes before its OK; with no credit the OK comes alone and the event waits
/// for credit.
#[test]
fn a_calls_own_event_is_written_before_its_answer() {
    let d = daemon("evfirst", 47230, &[1]);
    let (mut s, _) = raw(&d);
    let resolve = |h| {
        Command::Call(
            h,
            Op::ResolveAddr {
                src: None,
                dst: sa(1, 7000),
            },
        )
    };
    let h = create(&mut s);
    s.send(&Command::GetEvent(1)).expect("credit");
    let seq = s.send(&resolve(h)).expect("send");
    let (_, first) = s.recv().expect("a frame");
    assert!(
        matches!(first, Message::Event { handle, event: WireEvent::AddrResolved, .. } if handle == h),
        "first {first:?}"
    );
    assert!(matches!(s.recv().expect("a frame"), (n, Message::Ok(_)) if n == seq));
    // No credit left: the answer, then nothing until credit comes.
    let h2 = create(&mut s);
    let seq = s.send(&resolve(h2)).expect("send");
    assert!(matches!(s.recv().expect("a frame"), (n, Message::Ok(_)) if n == seq));
    assert_silent(&mut s, Duration::from_millis(200));
    s.send(&Command::GetEvent(1)).expect("credit");
    assert!(matches!(
        s.next_event().expect("event"),
        Message::Event { handle, event: WireEvent::AddrResolved, .. } if handle == h2
    ));
    drop(s);
    wait_ids(&d, 0, 0);
}

/// Dropping a client's last `Fabric` handle ends its session, as exiting does: the ids it
/// held (a `CmId` handle still in hand included) are destroyed at the daemon and the peer
/// sees DISCONNECTED.
#[test]
fn dropping_the_client_fabric_ends_its_session() {
    let d = daemon("dropfab", 47218, &[1]);
    let server = rcm_ucm::fabric(d.socket()).expect("server");
    let client = rcm_ucm::fabric(d.socket()).expect("client");
    let (l, sch) = listen(&server, sa(1, 7500));
    let cch = EventChannel::new();
    let c = dial(&client, &cch, sa(1, 7500), b"dropped");
    let child = accept_next(&sch, b"ok");
    finish_connect(&c, &cch, &sch);
    assert_eq!(d.sessions(), 2);
    drop(client);
    let e = next(&sch);
    assert!(matches!(e.event(), Event::Disconnected), "{e:?}");
    drop(e);
    wait_until(
        || d.sessions() == 1,
        || format!("{} sessions", d.sessions()),
    );
    assert!(c.disconnect().is_err());
    for id in [child, l] {
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    wait_ids(&d, 0, 0);
}

// ---------------------------------------------------------------------------------------
// h. Startup and shutdown

/// A daemon whose socket file was removed (by a /tmp cleaner, say) still stops when asked
/// (it waited for ever: it woke its accept thread by connecting to the path), and it leaves
/// alone the socket of another daemon that took the path meanwhile.
#[test]
fn stopping_after_the_socket_path_was_taken_over() {
    let a = daemon("takeover", 47222, &[1]);
    std::fs::remove_file(a.socket()).expect("remove the socket file");
    let b = Daemon::start(config("takeover", 47223, &[2])).expect("a daemon on the freed path");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        a.shutdown();
        let _ = tx.send(());
    });
    rx.recv_timeout(T).expect("the first daemon stopped");
    assert!(
        std::os::unix::net::UnixStream::connect(b.socket()).is_ok(),
        "the second daemon's socket is still there and answers"
    );
    b.shutdown();
}

#[test]
fn startup_rules_socket_mode_and_shutdown() {
    let name = "startup";
    let path = sock(name);
    let _ = std::fs::remove_file(&path);
    // A regular file at the path is refused and left alone.
    std::fs::write(&path, b"precious").expect("write");
    match Daemon::start(config(name, 47212, &[1])) {
        Err(DaemonError::NotASocket(p)) => assert_eq!(p, path),
        Err(e) => panic!("expected NotASocket, got {e}"),
        Ok(_) => panic!("expected NotASocket, got a daemon"),
    }
    assert_eq!(std::fs::read(&path).expect("read"), b"precious");
    std::fs::remove_file(&path).expect("rm");
    // A stale socket (nobody accepts on it) is replaced.
    drop(std::os::unix::net::UnixListener::bind(&path).expect("stale socket"));
    assert!(path.exists());
    let d = Daemon::start(config(name, 47212, &[1])).expect("replaces a stale socket");
    let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
    assert_eq!(mode & 0o777, 0o660, "socket mode {mode:o}");
    // A live daemon's path is refused (and the live daemon keeps serving).
    match Daemon::start(config(name, 47213, &[2])) {
        Err(DaemonError::AlreadyRunning(p)) => assert_eq!(p, path),
        Err(e) => panic!("expected AlreadyRunning, got {e}"),
        Ok(_) => panic!("expected AlreadyRunning, got a second daemon"),
    }
    let (mut s, _) = raw(&d);
    assert!(matches!(ok(&mut s, &Command::Devices), Answer::Devices(v) if v == vec![ip(1)]));
    drop(s);

    // A connection between a daemon client and an in-process peer (127.0.0.2, same UDP
    // port): shutting the daemon down disconnects it.
    let local = Fabric::new(FabricConfig {
        udp_port: 47212,
        ..config(name, 47212, &[1]).fabric
    });
    local.add_device(ip(2)).expect("local device");
    let server = rcm_ucm::fabric(d.socket()).expect("server");
    let (l, sch) = listen(&server, sa(1, 7600));
    let pch = EventChannel::new();
    let p = dial(&local, &pch, sa(1, 7600), b"peer");
    let child = accept_next(&sch, b"");
    finish_connect(&p, &pch, &sch);
    d.shutdown();
    assert!(!path.exists(), "shutdown removes the socket file");
    let e = next(&pch);
    assert!(matches!(e.event(), Event::Disconnected), "{e:?}");
    drop(e);
    assert_eq!(p.destroy(), Ok(DestroyOutcome::Done));
    drop((child, l));
    local.shutdown();
    server.shutdown();
}

// ---------------------------------------------------------------------------------------
// i. Losing the daemon

#[test]
fn losing_the_daemon_is_one_device_removal_per_id() {
    let d = daemon("lose", 47214, &[1]);
    let f = rcm_ucm::fabric(d.socket()).expect("session");
    let ch = EventChannel::new();
    let idle = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
    let (l, lch) = listen(&f, sa(1, 7700));
    let c = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
    c.resolve_addr(None, sa(1, 7700)).expect("resolve");
    let e = next(&ch);
    assert!(matches!(e.event(), Event::AddrResolved));
    drop(e);
    d.shutdown();
    let mut seen = Vec::new();
    for chan in [&ch, &ch, &lch] {
        let e = next(chan);
        assert!(matches!(e.event(), Event::DeviceRemoval), "{e:?}");
        seen.push(e.id().clone());
    }
    assert!(seen.contains(&idle) && seen.contains(&c) && seen.contains(&l));
    // Exactly one each.
    assert!(ch.get_event(Some(Duration::from_millis(300))).is_none());
    assert!(lch.get_event(Some(Duration::from_millis(10))).is_none());
    drop(seen);
    for id in [&idle, &l, &c] {
        assert_eq!(id.bind(sa(1, 7701)), Err(rcm::Error::DeviceRemoved));
        assert_eq!(
            id.resolve_addr(None, sa(1, 7700)),
            Err(rcm::Error::DeviceRemoved)
        );
        assert_eq!(id.resolve_route(), Err(rcm::Error::DeviceRemoved));
        assert_eq!(id.listen(1), Err(rcm::Error::DeviceRemoved));
        assert_eq!(
            id.connect(&ConnectOptions::default()),
            Err(rcm::Error::DeviceRemoved)
        );
        assert_eq!(id.disconnect(), Err(rcm::Error::DeviceRemoved));
        assert_eq!(id.call(Op::Query), Err(rcm::Error::DeviceRemoved));
    }
    assert_eq!(
        f.try_create_id_on(PortSpace::Tcp, &ch).err(),
        Some(rcm::Error::DeviceRemoved)
    );
    for id in [idle, l, c] {
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    assert_eq!(f.live_ids(), 0);
}

// ---------------------------------------------------------------------------------------
// j. Handshake

#[test]
fn handshake_comes_first_and_versions_are_checked() {
    let d = daemon("hello", 47215, &[1]);
    let mut s = RawSession::connect(d.socket()).expect("connect");
    let before = [
        Command::Stats,
        Command::Devices,
        Command::CreateId(PortSpace::Tcp),
        Command::DestroyId(1),
        Command::GetEvent(5),
        Command::MigrateId {
            token: 1,
            handle: 1,
        },
        Command::Call(1, Op::Query),
    ];
    for cmd in &before {
        assert!(
            matches!(err(&mut s, cmd), WireError::Handshake(_)),
            "{cmd:?} before Hello"
        );
    }
    for (min, max) in [
        (proto::VERSION + 1, proto::VERSION + 8),
        (0, 0),
        (0, proto::VERSION - 1),
        (proto::VERSION + 1, u16::MAX),
        (5, 1),
    ] {
        assert!(matches!(
            err(&mut s, &Command::Hello { min, max }),
            WireError::Handshake(_)
        ));
    }
    // A Hello with a wrong magic is not a Hello at all.
    let mut bad = Command::Hello { min: 1, max: 1 }.encode(77);
    bad[12] ^= 0xFF;
    s.send_bytes(&bad).expect("send");
    assert!(matches!(
        s.wait_reply(77).expect("reply"),
        Message::Err(WireError::BadMessage(_))
    ));
    // The session is still there and can now open properly, with a range around VERSION.
    match s
        .call(&Command::Hello {
            min: 0,
            max: proto::VERSION + 3,
        })
        .expect("reply")
    {
        Message::HelloOk {
            version,
            token,
            limits,
        } => {
            assert_eq!(version, proto::VERSION);
            assert_ne!(token, 0);
            assert_eq!(limits, Limits::default());
        }
        m => panic!("expected HelloOk, got {m:?}"),
    }
    assert!(matches!(
        err(&mut s, &Command::Hello { min: 1, max: 1 }),
        WireError::Handshake(_)
    ));
    assert_eq!(stats(&mut s).ids, 0);
    // GetEvent before Hello granted nothing: no credit now.
    assert_eq!(stats(&mut s).credit, 0);
    let h = create(&mut s);
    ok(&mut s, &Command::DestroyId(h));
    drop(s);
    wait_ids(&d, 0, 0);
}

#[test]
fn a_frame_shorter_than_its_header_ends_the_session_with_a_reason() {
    let d = daemon("shortlen", 47216, &[1]);
    let (mut s, _) = raw(&d);
    // len = 7 (< 8): the stream cannot be resynchronised.
    let mut f = Vec::new();
    f.extend_from_slice(&7u32.to_le_bytes());
    f.extend_from_slice(&proto::kind::STATS.to_le_bytes());
    f.extend_from_slice(&[0; 6]);
    s.send_bytes(&f).expect("send");
    match s.recv() {
        Ok((0, Message::Err(WireError::BadMessage(_)))) => {}
        other => panic!("expected BadMessage with seq 0 before the end, got {other:?}"),
    }
    let e = s.recv().expect_err("the session ends");
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
    wait_until(
        || d.sessions() == 0,
        || format!("{} sessions", d.sessions()),
    );
}

// ---------------------------------------------------------------------------------------
// Lock order: destroying a listener while its unread children get events

/// Found by this test: `destroy_id` used to lock each unread child's cell while holding the
/// session table and queue, while `on_event` for such a child holds the child's cell and then
/// locks the queue. When the peers give up on their connects (REJ → an event on each child)
/// just as the listener is destroyed, the reader and the callback threads deadlocked. Now the
/// child cells are cleared after the locks are released. On a hang this fails after 5 s
/// (leaking the wedged daemon instead of joining its threads).
#[test]
fn destroying_a_listener_while_its_children_get_events() {
    let d = Daemon::start(config_patient("lockorder", 47217, &[1])).expect("daemon");
    let peer = rcm_ucm::fabric(d.socket()).expect("peer");
    let t0 = Instant::now();
    let mut n = 0;
    while t0.elapsed() < Duration::from_secs(8) {
        n += 1;
        let (mut a, ta) = raw(&d);
        a.set_timeout(Duration::from_secs(5)).expect("timeout");
        let lh = raw_listener(&mut a, sa(1, 7800), 64);
        let ch = EventChannel::new();
        let dials: Vec<_> = (0..6).map(|_| dial(&peer, &ch, sa(1, 7800), b"")).collect();
        wait_stats(&mut a, |s| s.queued_events == 6, "6 unread requests");
        let (mut b, _) = raw(&d);
        b.set_timeout(Duration::from_secs(5)).expect("timeout");
        let go = Arc::new(Barrier::new(3));
        let g = go.clone();
        let migrator = std::thread::spawn(move || {
            g.wait();
            let seqs: Vec<u32> = (lh + 1..=lh + 6)
                .rev()
                .map(|h| {
                    b.send(&Command::MigrateId {
                        token: ta,
                        handle: h,
                    })
                    .expect("send")
                })
                .collect();
            seqs.into_iter().all(|s| b.wait_reply(s).is_ok())
        });
        let g = go.clone();
        let rejecter = std::thread::spawn(move || {
            g.wait();
            for c in dials {
                drop(c.begin_destroy());
            }
        });
        go.wait();
        let seq = a.send(&Command::DestroyId(lh)).expect("send");
        let answered = a.wait_reply(seq).is_ok();
        let migrated = migrator.join().expect("migrator");
        rejecter.join().expect("rejecter");
        if !answered || !migrated {
            // Joining the daemon's wedged threads would hang the test binary.
            std::mem::forget(d);
            std::mem::forget(peer);
            panic!(
                "round {n}: destroy answered={answered}, migrates answered={migrated}: \
                 the daemon deadlocked"
            );
        }
        drop(a);
        wait_until(
            || d.sessions() == 1,
            || format!("{} sessions", d.sessions()),
        );
        wait_ids(&d, 0, 0);
    }
    eprintln!("{n} rounds without a deadlock");
    peer.shutdown();
}

#[test]
fn a_connection_that_never_opens_its_session_is_closed() {
    use std::io::{Read, Write};
    let mut cfg = config("handshake", 47225, &[1]);
    cfg.handshake_timeout = Duration::from_millis(300);
    let d = Daemon::start(cfg).expect("daemon");
    // Silent; half a frame header; and a session that said Hello in time, then nothing.
    let mut silent = std::os::unix::net::UnixStream::connect(d.socket()).expect("connect");
    let mut partial = std::os::unix::net::UnixStream::connect(d.socket()).expect("connect");
    partial.write_all(&[0u8; 5]).expect("write");
    let (mut open, _) = RawSession::open(d.socket()).expect("session");
    // (Accepted in order: the two are sessions of the daemon's by now.)
    wait_until(
        || d.sessions() == 1,
        || format!("{} sessions after the handshake timeout", d.sessions()),
    );
    let mut b = [0u8; 1];
    silent.set_read_timeout(Some(T)).expect("timeout");
    assert_eq!(silent.read(&mut b).expect("closed, not timed out"), 0);
    partial.set_read_timeout(Some(T)).expect("timeout");
    assert_eq!(partial.read(&mut b).expect("closed, not timed out"), 0);
    // The open session keeps its place however long it stays quiet.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(d.sessions(), 1);
    create(&mut open);
}

#[test]
fn a_connection_that_talks_without_opening_its_session_is_closed_too() {
    use std::io::Write;
    let mut cfg = config("handshake-talk", 47226, &[1]);
    cfg.handshake_timeout = Duration::from_millis(300);
    let d = Daemon::start(cfg).expect("daemon");
    // Commands before HELLO, without pause and without reading the refusals they get: the
    // daemon's answers fill the socket both ways, and its reader must not wait on them for
    // good; nor may the stream of commands keep the connection past its deadline.
    let mut c = std::os::unix::net::UnixStream::connect(d.socket()).expect("connect");
    let frame = Command::Stats.encode(5);
    let writer = std::thread::spawn(move || {
        let t0 = std::time::Instant::now();
        while t0.elapsed() < T {
            if c.write_all(&frame).is_err() {
                return true;
            }
        }
        false
    });
    wait_until(
        || d.sessions() == 0,
        || format!("{} sessions after the handshake timeout", d.sessions()),
    );
    assert!(writer.join().expect("writer"), "the connection stayed open");
}

#[test]
fn connections_past_the_limit_are_refused_and_the_daemon_serves_on() {
    use std::io::Read;
    let mut cfg = config("conn-limit", 47227, &[1, 2]);
    cfg.max_connections = 4;
    let d = Daemon::start(cfg).expect("daemon");
    // One session and connections that have said nothing yet: all count.
    let (mut open, _) = RawSession::open(d.socket()).expect("session");
    let mut silent: Vec<_> = (0..3)
        .map(|_| std::os::unix::net::UnixStream::connect(d.socket()).expect("connect"))
        .collect();
    wait_until(
        || d.connections() == 4,
        || format!("{} connections", d.connections()),
    );
    // A fifth is answered with the typed refusal and closed, whatever it would have said.
    let mut over = RawSession::connect(d.socket()).expect("connect");
    over.set_timeout(T).expect("timeout");
    match over.recv().expect("an answer") {
        (0, Message::Err(WireError::Cm(rcm::Error::LimitExceeded(Limit::Connections)))) => {}
        other => panic!("{other:?}"),
    }
    let mut b = [0u8; 1];
    assert_eq!(over.stream().read(&mut b).expect("closed"), 0);
    assert!(matches!(
        rcm_ucm::fabric(d.socket()).map(|_| ()),
        Err(rcm::Error::LimitExceeded(Limit::Connections))
    ));
    assert!(d.refused_connections() >= 2);
    assert_eq!(d.connections(), 4);
    // The session it serves is not disturbed.
    create(&mut open);
    // With a place free, a client library session opens; its threads' calls find no room
    // for a command channel and go on the session's connection; once places free up
    // again, a later call attaches one (the refusal was not taken as for good).
    drop(silent.pop());
    wait_until(
        || d.connections() == 3,
        || format!("{} connections", d.connections()),
    );
    let f = rcm_ucm::fabric(d.socket()).expect("a session in the free place");
    let refused = d.refused_connections();
    let id = f
        .try_create_id_on(rcm::PortSpace::Tcp, &rcm::EventChannel::new())
        .expect("create without a channel");
    id.bind(sa(2, 0)).expect("bind without a channel");
    for _ in 0..50 {
        let _ = id.local_addr();
    }
    assert_eq!(d.channels(), 0);
    // Refused once, the session makes its calls without trying again for a while (not one
    // refused connection per call).
    let knocks = d.refused_connections() - refused;
    assert!((1..=5).contains(&knocks), "{knocks} refused attaches");
    drop((open, silent));
    wait_until(
        || d.connections() == 1,
        || format!("{} connections", d.connections()),
    );
    wait_until(
        || {
            let _ = id.local_addr();
            d.channels() == 1
        },
        || format!("{} channels", d.channels()),
    );
    id.destroy().expect("destroy");
}

#[test]
fn channels_leave_a_quarter_of_the_connections_to_sessions() {
    let mut cfg = config("conn-reserve", 47228, &[1]);
    cfg.max_connections = 8;
    let d = Daemon::start(cfg).expect("daemon");
    let (mut s, token) = RawSession::open(d.socket()).expect("session");
    // The session and five channels: six of eight; a seventh connection as a channel would
    // leave fewer than two places free.
    let chans: Vec<RawSession> = (0..5).map(|_| channel(&d, token)).collect();
    let mut c = RawSession::connect(d.socket()).expect("connect");
    c.set_timeout(T).expect("timeout");
    assert_eq!(
        err(&mut c, &attach_cmd(token)),
        WireError::Cm(rcm::Error::LimitExceeded(Limit::Connections))
    );
    drop(c);
    wait_until(
        || d.connections() == 6,
        || format!("{} connections", d.connections()),
    );
    // Those two places are for sessions.
    let others: Vec<RawSession> = (0..2)
        .map(|_| {
            RawSession::open(d.socket())
                .expect("a session in a kept place")
                .0
        })
        .collect();
    assert_eq!((d.sessions(), d.channels(), d.connections()), (3, 5, 8));
    // Full: the next connection is refused whatever it is.
    assert!(matches!(
        rcm_ucm::fabric(d.socket()).map(|_| ()),
        Err(rcm::Error::LimitExceeded(Limit::Connections))
    ));
    create(&mut s);
    drop((chans, others));
}

/// Clients that come and go leave no threads behind them: each ending connection joins the
/// reader threads of those that ended before it (they were joined only when the next client
/// came, so a burst of short-lived clients kept one thread's stack each until then: 20
/// here).
#[test]
fn ended_connections_leave_no_unjoined_threads() {
    let d = daemon("reap", 47236, &[1]);
    // All open first, so that no new connection comes after they end.
    let sessions: Vec<_> = (0..20).map(|_| raw(&d).0).collect();
    wait_until(|| d.connections() == 20, || format!("{}", d.connections()));
    for (i, s) in sessions.into_iter().enumerate() {
        drop(s);
        wait_until(
            || d.connections() == 19 - i,
            || format!("session {i} still served: {}", d.connections()),
        );
    }
    // The last to end is joined by none; one that ended while another was joining may
    // have been still on its way out (a loaded machine may leave a couple so).
    wait_until(
        || d.unjoined_threads() <= 4,
        || format!("{} ended threads not joined", d.unjoined_threads()),
    );
    d.shutdown();
}
