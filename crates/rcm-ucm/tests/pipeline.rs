//! Pipelined calls (`rcm::Pipeline`) through the daemon: the calls that return nothing but
//! success go without waiting for their answers, a failure comes as the id's error event,
//! the thread's later calls stay behind them, and what is owed is awaited when the pipeline
//! ends, before the thread waits for an event, or (opened in a callback of the session's
//! reader) when the reader's batch of callbacks ends.

mod common;

use common::*;
use rcm::{
    AcceptOptions, CallbackMode, ConnectOptions, Event, EventChannel, FabricConfig, Flow,
    PortSpace, State,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A one-address daemon, a session of it, and a channel for its ids' events.
fn session(name: &str, port: u16) -> (rcm_ucm::Daemon, rcm::Fabric, EventChannel) {
    let d = daemon(name, port, &[1]);
    let f = rcm_ucm::fabric(d.socket()).expect("client");
    (d, f, EventChannel::new())
}

/// A one-address daemon whose sessions may hold `max_ids` ids.
fn daemon_holding(name: &str, port: u16, max_ids: u32) -> rcm_ucm::Daemon {
    daemon_with_limits(
        name,
        port,
        &[1],
        rcm_ucm::proto::Limits {
            max_ids,
            ..rcm_ucm::proto::Limits::default()
        },
    )
}

/// A session of `d` whose reader runs the callbacks of what it reads (`CallbackMode::Inline`).
fn inline_session(d: &rcm_ucm::Daemon) -> rcm::Fabric {
    rcm_ucm::fabric_with(
        d.socket(),
        FabricConfig {
            callbacks: CallbackMode::Inline,
            ..FabricConfig::default()
        },
    )
    .expect("session")
}

/// An id of `f` whose ADDR_RESOLVED callback is running when this returns, and stays until
/// `release` brings something or is dropped (10 s at most).
fn held_in_callback(f: &rcm::Fabric, release: std::sync::mpsc::Receiver<()>) -> rcm::CmId {
    let (entered_tx, entered) = std::sync::mpsc::channel();
    let release = Mutex::new(release);
    let id = f.create_id(PortSpace::Tcp, move |_, ev| {
        if matches!(ev, Event::AddrResolved) {
            let _ = entered_tx.send(());
            let _ = release
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .recv_timeout(T);
        }
        Flow::Continue
    });
    id.resolve_addr(None, sa(1, 7472)).expect("resolve_addr");
    entered.recv_timeout(T).expect("the callback runs");
    id
}

#[test]
fn a_pipelined_call_that_fails_returns_ok_and_its_failure_is_the_ids_event_when_the_pipeline_ends()
{
    let (_d, f, ch) = session("pl-fail", 47870);
    let id = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
    // Without a pipeline the daemon's refusal is the call's error: no route resolved.
    let refused = id
        .connect(&ConnectOptions::default())
        .expect_err("a connect before the route is refused");
    {
        let _p = rcm::Pipeline::begin();
        id.connect(&ConnectOptions::default())
            .expect("a pipelined call returns once written");
    }
    // The pipeline's end awaited the answer and delivered the failure: it is queued now.
    let ev = ch
        .get_event(Some(Duration::ZERO))
        .expect("CONNECT_ERROR queued when the pipeline ended");
    match ev.event() {
        Event::ConnectError(e) => assert_eq!(e.to_string(), refused.to_string()),
        other => panic!("expected CONNECT_ERROR, got {other:?}"),
    }
    drop(ev);
    assert!(ch.get_event(Some(Duration::from_millis(50))).is_none());
    // The failed calls changed nothing.
    assert_eq!(id.state(), State::Idle);
}

#[test]
fn a_thread_waiting_for_an_event_first_awaits_what_its_open_pipeline_is_owed() {
    let (_d, f, ch) = session("pl-wait", 47871);
    let id = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
    let _p = rcm::Pipeline::begin();
    id.resolve_route()
        .expect("a pipelined call returns once written");
    // Nobody else reads the channel's answers: without this wait's own look at them the
    // ROUTE_ERROR would never come while the pipeline is open.
    let ev = next(&ch);
    assert!(
        matches!(ev.event(), Event::RouteError(_)),
        "expected ROUTE_ERROR, got {ev:?}"
    );
}

#[test]
fn a_call_after_pipelined_ones_goes_behind_them() {
    let (_d, f, ch) = session("pl-order", 47872);
    let ids: Vec<_> = (0..50)
        .map(|_| f.try_create_id_on(PortSpace::Tcp, &ch).expect("create"))
        .collect();
    let _p = rcm::Pipeline::begin();
    for id in &ids {
        id.resolve_addr(None, sa(1, 7471)).expect("pipelined");
        // A query (which waits for its answer) made right after sees the resolve done or
        // under way, never the idle id it was before.
        let st = id.state();
        assert!(
            matches!(st, State::AddrQuery | State::AddrResolved),
            "a query overtook the pipelined resolve_addr: {st:?}"
        );
    }
    for _ in &ids {
        let ev = next(&ch);
        assert!(matches!(ev.event(), Event::AddrResolved), "{ev:?}");
    }
}

#[test]
fn more_pipelined_calls_than_the_answer_ring_holds_all_complete() {
    // An answer takes 24 bytes of a 64 KiB ring: 2,730 fill it. The daemon takes no more
    // commands from a channel whose answer ring is full, so the writing thread must read
    // answers while it writes.
    const N: usize = 4000;
    let (_d, f, ch) = session("pl-many", 47873);
    let ids: Vec<_> = (0..N)
        .map(|_| f.try_create_id_on(PortSpace::Tcp, &ch).expect("create"))
        .collect();
    {
        let _p = rcm::Pipeline::begin();
        for (k, id) in ids.iter().enumerate() {
            // Every tenth fails in the daemon (a route before the address): its failure
            // is its event; the others resolve.
            if k % 10 == 0 {
                id.resolve_route().expect("pipelined");
            } else {
                id.resolve_addr(None, sa(1, 7471)).expect("pipelined");
            }
        }
    }
    let (mut resolved, mut route_errors) = (0, 0);
    while resolved + route_errors < N {
        let ev = next(&ch);
        match ev.event() {
            Event::AddrResolved => resolved += 1,
            Event::RouteError(_) => route_errors += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((resolved, route_errors), (N - N / 10, N / 10));
}

#[test]
fn accepts_pipelined_in_inline_callbacks_connect_and_a_refused_one_is_the_childs_event() {
    const N: usize = 20;
    let d = daemon("pl-inline", 47874, &[1, 2]);
    let server = inline_session(&d);
    let accepted = Arc::new(AtomicUsize::new(0));
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let (a, s) = (accepted.clone(), seen.clone());
    let l = server.create_id(PortSpace::Tcp, move |id, ev| {
        match ev {
            Event::ConnectRequest { .. } => {
                let _p = rcm::Pipeline::begin();
                id.accept(&AcceptOptions::default()).expect("pipelined");
                // A second accept of the same request: the daemon refuses it, after this
                // callback, as the child's CONNECT_ERROR.
                id.accept(&AcceptOptions::default()).expect("pipelined");
                a.fetch_add(1, Ordering::SeqCst);
            }
            other => s
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(other.name().to_string()),
        }
        Flow::Continue
    });
    l.bind(sa(1, 7471)).expect("bind");
    l.listen(64).expect("listen");
    let client = rcm_ucm::fabric(d.socket()).expect("client session");
    // A channel each: a connection's CONNECT_RESPONSE may come while the next one dials.
    let conns: Vec<_> = (0..N)
        .map(|_| {
            let cch = EventChannel::new();
            let id = dial(&client, &cch, sa(1, 7471), b"pl");
            (id, cch)
        })
        .collect();
    for (id, cch) in &conns {
        establish_on_response(id, cch);
    }
    assert_eq!(accepted.load(Ordering::SeqCst), N);
    wait_until(
        || {
            let s = seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            s.iter().filter(|n| *n == "CONNECT_ERROR").count() == N
                && s.iter().filter(|n| *n == "ESTABLISHED").count() == N
        },
        || format!("server events: {:?}", seen.lock().map(|s| s.clone())),
    );
    drop(conns);
}

#[test]
fn a_pipeline_changes_nothing_for_ids_of_devices_in_this_process() {
    let f = rcm::Fabric::new(FabricConfig {
        udp_port: 47875,
        ..FabricConfig::default()
    });
    f.add_device(ip(1)).expect("device");
    let ch = EventChannel::new();
    let id = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
    let _p = rcm::Pipeline::begin();
    assert!(
        id.connect(&ConnectOptions::default()).is_err(),
        "an in-process call still returns its failure"
    );
    assert!(ch.get_event(Some(Duration::from_millis(50))).is_none());
}

#[test]
fn a_release_in_a_pipeline_goes_before_the_threads_next_call() {
    let d = daemon_holding("pl-release", 47876, 1);
    let f = rcm_ucm::fabric(d.socket()).expect("client");
    let ch = EventChannel::new();
    for _ in 0..50 {
        let id = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
        let _p = rcm::Pipeline::begin();
        id.resolve_addr(None, sa(1, 7471)).expect("pipelined");
        // Not waited for: the release goes behind the resolve, without its answer.
        drop(id.begin_destroy());
        drop(id);
        // At the limit of one id, the next create succeeds only behind that release.
        let next = f
            .try_create_id_on(PortSpace::Tcp, &ch)
            .expect("create after release");
        drop(next.begin_destroy());
    }
    wait_ids(&d, 0, 0);
}

#[test]
fn a_thread_that_ends_inside_a_pipeline_gives_its_channel_up() {
    let d = daemon("pl-leak", 47877, &[1]);
    let c = rcm_ucm::Client::connect(d.socket()).expect("session");
    let f = rcm::Fabric::with_provider(Arc::new(c.clone()), FabricConfig::default());
    let ch = EventChannel::new();
    // Each thread leaks its pipeline (the guard never drops), calls, and ends: its call is
    // served and the channel it kept goes back to the session (reused by the next thread).
    for _ in 0..10 {
        let id = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
        std::thread::scope(|s| {
            s.spawn(|| {
                std::mem::forget(rcm::Pipeline::begin());
                id.resolve_addr(None, sa(1, 7471)).expect("pipelined");
            });
        });
        let ev = next(&ch);
        assert!(matches!(ev.event(), Event::AddrResolved), "{ev:?}");
    }
    // (A thread's locals are dropped after `scope` saw it finish, so the main thread's
    // next call may attach a second channel before the first is back.)
    assert!(
        c.mapped_channels() <= 2,
        "{} channels mapped: the ended threads' were not given back",
        c.mapped_channels()
    );
}

#[test]
fn disconnects_pipelined_once_established_take_both_ends_down() {
    const N: usize = 20;
    let d = daemon("pl-disc", 47878, &[1, 2]);
    let server = rcm_ucm::fabric(d.socket()).expect("server session");
    let client = rcm_ucm::fabric(d.socket()).expect("client session");
    let (l, lch) = listen(&server, sa(1, 7471));
    let sch = EventChannel::new();
    let conns: Vec<_> = (0..N)
        .map(|_| {
            let cch = EventChannel::new();
            let c = dial(&client, &cch, sa(1, 7471), b"pl");
            let child = accept_next(&lch, b"pl");
            child.migrate(&sch).expect("migrate");
            finish_connect(&c, &cch, &sch);
            (c, cch, child)
        })
        .collect();
    {
        let _p = rcm::Pipeline::begin();
        for (c, _, _) in &conns {
            c.disconnect().expect("pipelined");
        }
    }
    for (_, cch, _) in &conns {
        let ev = next(cch);
        assert!(matches!(ev.event(), Event::Disconnected), "client: {ev:?}");
    }
    for _ in 0..N {
        let ev = next(&sch);
        assert!(matches!(ev.event(), Event::Disconnected), "server: {ev:?}");
    }
    // Nothing else: a disconnect that succeeded has no event of its own.
    for (_, cch, _) in &conns {
        assert!(cch.get_event(Some(Duration::from_millis(20))).is_none());
    }
    drop(l);
}

#[test]
fn a_pipelined_disconnect_refused_for_a_removed_device_is_the_ids_connect_error() {
    let d = daemon("pl-disc-gone", 47879, &[1]);
    let server = rcm_ucm::fabric(d.socket()).expect("server session");
    // Inline: the client's reader runs callbacks, so one that blocks holds back the
    // DEVICE_REMOVAL below (an id that has seen it refuses calls itself, sending nothing).
    let client = inline_session(&d);
    let (_l, lch) = listen(&server, sa(1, 7471));
    let (cch, sch) = (EventChannel::new(), EventChannel::new());
    let c = dial(&client, &cch, sa(1, 7471), b"pl");
    {
        // Not established yet (no REP taken): not pipelined, the refusal is its return.
        let _p = rcm::Pipeline::begin();
        assert!(
            matches!(
                c.disconnect(),
                Err(rcm::Error::InvalidState(State::Connect))
            ),
            "a disconnect before ESTABLISHED must return its refusal"
        );
    }
    let child = accept_next(&lch, b"pl");
    child.migrate(&sch).expect("migrate");
    finish_connect(&c, &cch, &sch);
    let (release, released) = std::sync::mpsc::channel();
    let holder = held_in_callback(&client, released);
    d.fabric().remove_device(ip(1)).expect("remove the device");
    {
        let _p = rcm::Pipeline::begin();
        c.disconnect().expect("pipelined once established");
    }
    let ev = cch
        .get_event(Some(Duration::ZERO))
        .expect("CONNECT_ERROR queued when the pipeline ended");
    assert!(
        matches!(ev.event(), Event::ConnectError(rcm::Error::DeviceRemoved)),
        "expected CONNECT_ERROR(DeviceRemoved), got {ev:?}"
    );
    drop(ev);
    release.send(()).expect("release the reader");
    let ev = next(&cch);
    assert!(matches!(ev.event(), Event::DeviceRemoval), "{ev:?}");
    drop(ev);
    assert!(matches!(c.disconnect(), Err(rcm::Error::DeviceRemoved)));
    drop(holder);
}

#[test]
fn ids_created_in_a_pipeline_are_usable_at_once_by_the_thread() {
    const N: usize = 200;
    let (d, f, ch) = session("pl-create", 47880);
    let ids: Vec<_> = {
        let _p = rcm::Pipeline::begin();
        (0..N)
            .map(|_| {
                let id = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
                // Behind its creation on the thread's channel: the daemon has the id by then.
                id.resolve_addr(None, sa(1, 7471)).expect("pipelined");
                id
            })
            .collect()
    };
    for _ in 0..N {
        let ev = next(&ch);
        assert!(matches!(ev.event(), Event::AddrResolved), "{ev:?}");
    }
    wait_ids(&d, N, N);
    for id in ids {
        assert_eq!(id.state(), State::AddrResolved);
        id.destroy().expect("destroy");
    }
    wait_ids(&d, 0, 0);
}

#[test]
fn a_create_refused_at_the_id_limit_in_a_pipeline_is_the_ids_connect_error() {
    let d = daemon_holding("pl-create-limit", 47881, 3);
    let f = rcm_ucm::fabric(d.socket()).expect("client");
    let ch = EventChannel::new();
    let ids: Vec<_> = {
        let _p = rcm::Pipeline::begin();
        (0..5)
            .map(|_| {
                f.try_create_id_on(PortSpace::Tcp, &ch)
                    .expect("a pipelined create returns once written")
            })
            .collect()
    };
    // The pipeline's end read the answers: the two over the limit have their error queued.
    for id in &ids[3..] {
        let ev = ch
            .get_event(Some(Duration::ZERO))
            .expect("CONNECT_ERROR queued when the pipeline ended");
        assert_eq!(ev.id(), id);
        assert!(
            matches!(
                ev.event(),
                Event::ConnectError(rcm::Error::LimitExceeded(rcm::remote::Limit::Ids))
            ),
            "{ev:?}"
        );
    }
    assert!(ch.get_event(Some(Duration::from_millis(20))).is_none());
    // The daemon holds the first three only; the others' calls fail, and they destroy.
    wait_ids(&d, 3, 3);
    for id in &ids[..3] {
        id.bind(sa(1, 0)).expect("bind within the limit");
    }
    for id in &ids[3..] {
        assert!(id.bind(sa(1, 0)).is_err(), "an id the daemon refused");
    }
    for id in ids {
        id.destroy().expect("destroy");
    }
    wait_ids(&d, 0, 0);
}

#[test]
fn a_bind_refused_in_a_pipeline_is_the_ids_addr_error_and_nothing_behind_it_binds_the_id() {
    let (d, f, ch) = session("pl-bind", 47884);
    let holder = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
    holder.bind(sa(1, 7496)).expect("bind");
    let id = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
    let listen = {
        let _p = rcm::Pipeline::begin();
        id.bind(sa(1, 7496))
            .expect("a pipelined bind returns once written");
        // Behind the bind on the thread's channel. Carried out on the unbound id it would
        // have listened on the wildcard address; the daemon refuses it with the bind's error.
        id.listen(0)
    };
    assert!(
        matches!(listen, Err(rcm::Error::AddrInUse(a)) if a == sa(1, 7496)),
        "{listen:?}"
    );
    let ev = ch
        .get_event(Some(Duration::ZERO))
        .expect("ADDR_ERROR queued when the listen read the bind's answer");
    assert_eq!(ev.id(), &id);
    assert!(
        matches!(ev.event(), Event::AddrError(rcm::Error::AddrInUse(_))),
        "{ev:?}"
    );
    drop(ev);
    assert!(ch.get_event(Some(Duration::from_millis(20))).is_none());
    // Sealed: a later bind, even to a free address, is refused the same way.
    assert!(matches!(id.bind(sa(1, 0)), Err(rcm::Error::AddrInUse(_))));
    assert_eq!(id.state(), State::Idle);
    id.destroy().expect("destroy");
    // Outside a pipeline a refused bind is the call's error, and the id binds afterwards.
    let plain = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
    assert!(matches!(
        plain.bind(sa(1, 7496)),
        Err(rcm::Error::AddrInUse(_))
    ));
    plain.bind(sa(1, 0)).expect("bind after a refused one");
    // Binds that succeed in a pipeline are binds: the ids resolve from where they are bound.
    let ids: Vec<_> = {
        let _p = rcm::Pipeline::begin();
        (0..20u16)
            .map(|k| {
                let id = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
                id.bind(sa(1, 7500 + k)).expect("pipelined bind");
                id.resolve_addr(None, sa(1, 7471)).expect("pipelined");
                id
            })
            .collect()
    };
    for _ in 0..20 {
        let ev = next(&ch);
        assert!(matches!(ev.event(), Event::AddrResolved), "{ev:?}");
    }
    for (k, id) in ids.iter().enumerate() {
        assert_eq!(id.local_addr(), Some(sa(1, 7500 + k as u16)));
    }
    for id in ids.into_iter().chain([holder, plain]) {
        id.destroy().expect("destroy");
    }
    wait_ids(&d, 0, 0);
}

#[test]
fn a_blocking_destroy_in_a_pipeline_that_waits_for_a_callback_first_awaits_what_is_owed() {
    let d = daemon("pl-destroy", 47883, &[1]);
    let f = rcm_ucm::fabric_with(
        d.socket(),
        FabricConfig {
            dispatcher_threads: 2,
            ..FabricConfig::default()
        },
    )
    .expect("client");
    let (refused_tx, refused) = std::sync::mpsc::channel();
    // Quiet ids (no callback in flight), made before A's callback holds a dispatcher thread.
    let ch = EventChannel::new();
    let quiet: Vec<_> = (0..20)
        .map(|_| f.try_create_id_on(PortSpace::Tcp, &ch).expect("create"))
        .collect();
    // A's callback waits (up to 10 s) until B's ROUTE_ERROR has come, which only reading the
    // answers of the pipeline below delivers.
    let a = held_in_callback(&f, refused);
    let refused_tx = Mutex::new(refused_tx);
    let b = f.create_id(PortSpace::Tcp, move |_, ev| {
        if matches!(ev, Event::RouteError(_)) {
            let _ = refused_tx
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .send(());
        }
        Flow::Continue
    });
    let t0 = std::time::Instant::now();
    {
        let _p = rcm::Pipeline::begin();
        for id in &quiet {
            assert_eq!(id.destroy(), Ok(rcm::DestroyOutcome::Done));
        }
        b.resolve_route()
            .expect("pipelined (refused: no address yet)");
        // A's callback is in flight: this destroy waits for it, and first reads what is
        // owed (nothing was written since B's call, which would have read answers there),
        // so B's ROUTE_ERROR comes and lets A's callback end.
        assert_eq!(a.destroy(), Ok(rcm::DestroyOutcome::Done));
    }
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "the destroy waited for a callback that waited for the pipeline's answers"
    );
    b.destroy().expect("destroy");
    wait_ids(&d, 0, 0);
}

/// Ids that had events on their way when destroyed: a destroy waited for, one in a
/// pipeline, and one by a callback's `Flow::Destroy` on the session's reader, through a
/// channel in shared memory (pipelined) or on a socket (a call). Each handle is held back
/// until its destroy's answer has come and the events it counts were taken (protocol §8),
/// and then let go: none stays held for good.
#[test]
fn every_way_of_destroying_lets_the_handle_go_once_its_events_are_taken() {
    let resolve = |id: &rcm::CmId| id.resolve_addr(None, nowhere()).expect("resolve");
    let all_let_go = |client: &rcm_ucm::Client| {
        wait_until(
            || client.held_ids() == 0 && client.handles_draining() == 0,
            || format!("{} handles still held back", client.handles_draining()),
        );
    };
    // Twenty ids destroyed by their callbacks at their first event, on the reader.
    let destroyed_by_callbacks = |f: &rcm::Fabric| {
        let gone = Arc::new(AtomicUsize::new(0));
        let ids: Vec<_> = (0..20)
            .map(|_| {
                let gone = gone.clone();
                f.create_id(PortSpace::Tcp, move |_, _| {
                    gone.fetch_add(1, Ordering::SeqCst);
                    Flow::Destroy
                })
            })
            .collect();
        ids.iter().for_each(resolve);
        wait_until(
            || gone.load(Ordering::SeqCst) == 20,
            || "the callbacks ran".into(),
        );
    };
    let d = daemon("pl-drain", 47888, &[1]);
    let inline = FabricConfig {
        callbacks: CallbackMode::Inline,
        ..FabricConfig::default()
    };
    let client = rcm_ucm::Client::connect_for(d.socket(), &inline).expect("session");
    let f = rcm::Fabric::with_provider(Arc::new(client.clone()), inline.clone());
    let ch = EventChannel::new();
    // Waited for, and in a pipeline, each with its ADDR_ERROR unread.
    for _ in 0..20 {
        let id = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
        resolve(&id);
        id.destroy().expect("destroy");
    }
    {
        let _p = rcm::Pipeline::begin();
        for _ in 0..20 {
            let id = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
            resolve(&id);
            drop(id.begin_destroy());
        }
    }
    // Through a channel in shared memory.
    destroyed_by_callbacks(&f);
    all_let_go(&client);
    // Through channels on sockets (a daemon that maps no memory): no pipeline there, each
    // destroy is a call on a channel.
    let mut cfg = config("pl-drain-sockets", 47889, &[1]);
    cfg.shared_memory = false;
    let sockets = rcm_ucm::Daemon::start(cfg).expect("daemon");
    let client = rcm_ucm::Client::connect_for(sockets.socket(), &inline).expect("session");
    let f = rcm::Fabric::with_provider(Arc::new(client.clone()), inline);
    destroyed_by_callbacks(&f);
    assert_eq!(client.mapped_channels(), 0, "the channels are on sockets");
    all_let_go(&client);
}

/// A UD id's ESTABLISHED (its SIDR resolved) makes no connection: `disconnect` is refused
/// there, and inside a pipeline the refusal is still the call's error, not `Ok` followed by
/// a surprise CONNECT_ERROR (the library took any ESTABLISHED for a connection's).
#[test]
fn a_pipelined_disconnect_of_a_ud_id_returns_its_refusal() {
    let (_d, f, ch) = session("pl-ud-disconnect", 47893);
    let lch = EventChannel::new();
    let l = f.try_create_id_on(PortSpace::Udp, &lch).expect("create");
    l.bind(sa(1, 7177)).expect("bind");
    l.listen(4).expect("listen");
    let c = f.try_create_id_on(PortSpace::Udp, &ch).expect("create");
    c.resolve_addr(None, sa(1, 7177)).expect("resolve_addr");
    assert!(matches!(next(&ch).event(), Event::AddrResolved));
    c.resolve_route().expect("resolve_route");
    assert!(matches!(next(&ch).event(), Event::RouteResolved));
    c.connect(&ConnectOptions::default()).expect("connect");
    let req = next(&lch);
    let child = req.id().clone();
    drop(req);
    child.accept(&AcceptOptions::default()).expect("accept");
    let ev = next(&ch);
    assert!(
        matches!(ev.event(), Event::Established { ud: Some(_), .. }),
        "{ev:?}"
    );
    drop(ev);
    let refused = c.disconnect().expect_err("a UD id has no connection");
    {
        let _p = rcm::Pipeline::begin();
        assert_eq!(
            c.disconnect().map_err(|e| e.to_string()),
            Err(refused.to_string()),
            "the pipelined disconnect returns the refusal"
        );
    }
    assert!(
        ch.get_event(Some(Duration::from_millis(100))).is_none(),
        "no CONNECT_ERROR follows"
    );
}
