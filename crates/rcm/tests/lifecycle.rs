//! The lifecycle guarantees of `rcm` (the numbered list in `lib.rs` and the points
//! 1–11), one or more tests each: serial, ordered callbacks; blocking, deferred and
//! non-blocking destroy; `Flow::Destroy`; device removal; channel events that hold their id;
//! migration; exactly-once context drop; cancellation of resolution events; shutdown.
//!
//! Every test runs its own fabric on a UDP port of its own (25000–25199) because tests run in
//! parallel and devices bind 127.0.0.x:port.
#![cfg(not(loom))]

use rcm::{
    AcceptOptions, CmId, ConnectOptions, DestroyOutcome, Error, Event, EventChannel, Fabric, Flow,
    PortSpace, State,
};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Barrier, Mutex};
use std::task::{Context, Poll, Wake};
use std::thread;
use std::time::{Duration, Instant};

mod common;
use common::*;

/// A channel-mode connection: listener on 127.0.0.1:`port`, client on 127.0.0.2.
struct Pair {
    srv: EventChannel,
    cli: EventChannel,
    listener: CmId,
    client: CmId,
    child: CmId,
}

fn channel_pair(f: &Fabric, port: u16) -> Pair {
    channel_pair_across(f, f, port)
}

/// Like [`channel_pair`], the listener on `server`'s fabric and the client on `client`'s.
fn channel_pair_across(server: &Fabric, client_f: &Fabric, port: u16) -> Pair {
    channel_pair_holding(server, client_f, port).0
}

/// [`channel_pair_across`], and the client's ESTABLISHED, taken and not yet acked.
fn channel_pair_holding(
    server: &Fabric,
    client_f: &Fabric,
    port: u16,
) -> (Pair, rcm::ChannelEvent) {
    let srv = EventChannel::new();
    let cli = EventChannel::new();
    let listener = server.create_id_on(PortSpace::Tcp, &srv);
    listener.bind(addr(1, port)).unwrap();
    listener.listen(0).unwrap();
    let (client, r) = dialed(client_f, &cli, None, addr(1, port));
    r.unwrap();
    let (child, ev) = next(&srv);
    assert!(matches!(ev, Event::ConnectRequest { .. }), "{ev:?}");
    child.accept(&AcceptOptions::default()).unwrap();
    expect_ev(&cli, &client, "CONNECT_RESPONSE");
    client.establish().unwrap();
    let established = cli.get_event(Some(T)).expect("ESTABLISHED");
    assert_eq!(established.id(), &client);
    assert!(matches!(established.event(), Event::Established { .. }));
    expect_ev(&srv, &child, "ESTABLISHED");
    let pair = Pair {
        srv,
        cli,
        listener,
        client,
        child,
    };
    (pair, established)
}

/// Two fabrics on UDP port `port`: a server's with a device on 127.0.0.1, a client's on
/// 127.0.0.2.
fn two_fabrics(port: u16) -> (Fabric, Fabric) {
    let server = Fabric::new(config(port));
    server.add_device(ip(1)).unwrap();
    let client_f = Fabric::new(config(port));
    client_f.add_device(ip(2)).unwrap();
    (server, client_f)
}

/// A client of `f` on `ch`, resolved to `dst` (from `src`, when given), and its `connect`.
fn dialed(
    f: &Fabric,
    ch: &EventChannel,
    src: Option<IpAddr>,
    dst: SocketAddr,
) -> (CmId, rcm::Result<()>) {
    let c = f.create_id_on(PortSpace::Tcp, ch);
    c.resolve_addr(src, dst).unwrap();
    expect_ev(ch, &c, "ADDR_RESOLVED");
    c.resolve_route().unwrap();
    expect_ev(ch, &c, "ROUTE_RESOLVED");
    let r = c.connect(&ConnectOptions::default());
    (c, r)
}

// ----- 1. Serial, ordered callbacks; independent ids ----------------------------------------

/// Point 1: four threads push events at one id at once; the callbacks never overlap and each
/// thread's events arrive in the order it pushed them.
#[test]
fn callbacks_of_one_id_never_overlap_and_keep_order() {
    const PER: u32 = 400;
    const THREADS: u32 = 4;
    let f = fabric(25001);
    let busy = Arc::new(AtomicBool::new(false));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (b, o, s) = (busy.clone(), overlaps.clone(), seen.clone());
    let id = f.create_id(PortSpace::Tcp, move |_, ev| {
        if b.swap(true, Ordering::SeqCst) {
            o.fetch_add(1, Ordering::SeqCst);
        }
        // Widen the window a concurrent callback would fall into.
        let spin = Instant::now();
        while spin.elapsed() < Duration::from_micros(20) {
            std::hint::spin_loop();
        }
        s.lock()
            .unwrap()
            .push(seq_of(&ev).expect("only AddrError events"));
        b.store(false, Ordering::SeqCst);
        Flow::Continue
    });
    let start = Arc::new(Barrier::new(THREADS as usize));
    let hs: Vec<_> = (0..THREADS)
        .map(|t| {
            let (id, start) = (id.clone(), start.clone());
            thread::spawn(move || {
                start.wait();
                for n in 0..PER {
                    poke(&id, (t << 12) | n);
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    assert!(
        eventually(T, || seen.lock().unwrap().len() == (PER * THREADS) as usize),
        "only {} of {} callbacks ran",
        seen.lock().unwrap().len(),
        PER * THREADS
    );
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "callbacks overlapped");
    let seen = seen.lock().unwrap().clone();
    for t in 0..THREADS {
        let mine: Vec<u32> = seen
            .iter()
            .filter(|s| *s >> 12 == t)
            .map(|s| s & 0xFFF)
            .collect();
        assert_eq!(mine, (0..PER).collect::<Vec<_>>(), "thread {t}'s events");
    }
    assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    f.shutdown();
}

/// Point 1: ids are independent: while one id's callback is blocked, another id's events are
/// still delivered.
#[test]
fn a_blocked_callback_does_not_hold_up_other_ids() {
    let f = fabric(25002);
    let gate = Gate::new();
    let (tx, rx) = mpsc::channel::<&'static str>();
    let (g, txa) = (gate.clone(), Mutex::new(tx.clone()));
    let a = f.create_id(PortSpace::Tcp, move |_, _| {
        txa.lock().unwrap().send("a").unwrap();
        g.wait();
        Flow::Continue
    });
    let txb = Mutex::new(tx);
    let b = f.create_id(PortSpace::Tcp, move |_, _| {
        txb.lock().unwrap().send("b").unwrap();
        Flow::Continue
    });
    poke(&a, 0);
    assert_eq!(rx.recv_timeout(T), Ok("a"));
    poke(&a, 1);
    for n in 0..3 {
        poke(&b, n);
        assert_eq!(
            rx.recv_timeout(T),
            Ok("b"),
            "b's event {n} while a is blocked"
        );
    }
    gate.open();
    assert_eq!(rx.recv_timeout(T), Ok("a"));
    assert_eq!(a.destroy(), Ok(DestroyOutcome::Done));
    assert_eq!(b.destroy(), Ok(DestroyOutcome::Done));
    f.shutdown();
}

// ----- 2. Blocking destroy -----------------------------------------------------------------

/// Point 2: a blocking destroy from another thread returns only after the running callback
/// returned; queued events are discarded; the handler's captures and the attached context
/// are each dropped exactly once, by the time destroy returns.
#[test]
fn blocking_destroy_waits_for_the_running_callback_then_drops_context_once() {
    let f = fabric(25003);
    let handler_drops = Arc::new(AtomicUsize::new(0));
    let ctx_drops = Arc::new(AtomicUsize::new(0));
    let calls = Arc::new(AtomicUsize::new(0));
    let finished = Arc::new(AtomicBool::new(false));
    let (entered_tx, entered_rx) = mpsc::channel();
    let captured = Tracked(handler_drops.clone());
    let (c, fin, etx) = (calls.clone(), finished.clone(), Mutex::new(entered_tx));
    let id = f.create_id(PortSpace::Tcp, move |_, _| {
        let _keep = &captured;
        c.fetch_add(1, Ordering::SeqCst);
        etx.lock().unwrap().send(()).unwrap();
        thread::sleep(Duration::from_millis(300));
        fin.store(true, Ordering::SeqCst);
        Flow::Continue
    });
    id.set_context(Tracked(ctx_drops.clone()));
    poke(&id, 0);
    entered_rx.recv_timeout(T).unwrap();
    for n in 1..5 {
        poke(&id, n);
    }
    assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    assert!(
        finished.load(Ordering::SeqCst),
        "destroy returned while the callback was still running"
    );
    assert_eq!(handler_drops.load(Ordering::SeqCst), 1, "handler captures");
    assert_eq!(ctx_drops.load(Ordering::SeqCst), 1, "context");
    assert_eq!(id.state(), State::Destroying);
    thread::sleep(Duration::from_millis(100));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "queued events were delivered"
    );
    // Destroying again is harmless and drops nothing twice.
    assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    assert_eq!(ctx_drops.load(Ordering::SeqCst), 1);
    assert_eq!(handler_drops.load(Ordering::SeqCst), 1);
    assert_eq!(f.live_ids(), 0);
    assert_eq!(f.bound_ports(), 0);
    f.shutdown();
}

// ----- 3. Flow::Destroy --------------------------------------------------------------------

/// Points 3 and 6: a callback returns `Flow::Destroy` while more events are queued and its
/// device is being removed: no further callback is made, device removal included, and the
/// removal completes.
#[test]
fn flow_destroy_stops_every_further_callback_including_device_removal() {
    let f = fabric(25004);
    let ctx = Arc::new(AtomicUsize::new(0));
    let (id, gate, calls, _entered, removal) =
        removal_behind_a_running_callback(&f, Flow::Destroy, |id| {
            id.set_context(Tracked(ctx.clone()));
        });
    assert_eq!(
        ctx.load(Ordering::SeqCst),
        0,
        "context dropped during the callback"
    );
    gate.open();
    removal
        .wait(T)
        .expect("removal completes: the id destroyed itself");
    assert_eq!(ctx.load(Ordering::SeqCst), 1);
    thread::sleep(Duration::from_millis(150));
    assert_eq!(*calls.lock().unwrap(), vec!["ADDR_ERROR"]);
    assert_eq!(id.state(), State::Destroying);
    assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    assert_eq!(f.live_ids(), 0);
    assert_eq!(f.bound_ports(), 0);
    f.shutdown();
}

/// An id whose callback notes each event's name, says it entered, and waits for the gate to
/// open before it returns `flow` (`prepare` sees it first), bound to 127.0.0.1, with its
/// first ADDR_ERROR's callback running, two more queued behind it, and the device's removal
/// begun.
#[allow(clippy::type_complexity)]
fn removal_behind_a_running_callback(
    f: &Fabric,
    flow: Flow,
    prepare: impl FnOnce(&CmId),
) -> (
    CmId,
    Arc<Gate>,
    Arc<Mutex<Vec<&'static str>>>,
    mpsc::Receiver<()>,
    rcm::Removal,
) {
    let gate = Gate::new();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let (entered_tx, entered_rx) = mpsc::channel();
    let (g, c, etx) = (gate.clone(), calls.clone(), Mutex::new(entered_tx));
    let id = f.create_id(PortSpace::Tcp, move |_, ev| {
        c.lock().unwrap().push(ev.name());
        let _ = etx.lock().unwrap().send(());
        g.wait();
        flow
    });
    prepare(&id);
    id.bind(addr(1, 0)).unwrap();
    // Bound to 127.0.0.1: resolving a destination off this host is an AddrError event.
    poke(&id, 0);
    entered_rx.recv_timeout(T).unwrap();
    poke(&id, 1);
    poke(&id, 2);
    let removal = f.remove_device(ip(1)).unwrap();
    (id, gate, calls, entered_rx, removal)
}

/// A device removal replaces the events still queued for an id: the callback in flight
/// finishes, the events queued behind it are never delivered, and `DEVICE_REMOVAL` is the
/// next and last (see `Event::DeviceRemoval`; Linux's ucma would deliver them first).
#[test]
fn a_device_removal_replaces_the_events_still_queued() {
    let f = fabric(25041);
    let (id, gate, calls, entered_rx, removal) =
        removal_behind_a_running_callback(&f, Flow::Continue, |_| {});
    gate.open();
    entered_rx.recv_timeout(T).expect("the removal's callback");
    assert!(
        entered_rx.recv_timeout(Duration::from_millis(150)).is_err(),
        "a callback after DEVICE_REMOVAL"
    );
    assert_eq!(*calls.lock().unwrap(), vec!["ADDR_ERROR", "DEVICE_REMOVAL"]);
    assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    removal.wait(T).expect("removal completes");
    f.shutdown();
}

// ----- 4. Destroy from inside callbacks ----------------------------------------------------

/// Point 4: destroy from the id's own callback returns `Deferred` at once; no later event is
/// delivered; the context is dropped after the callback returns, exactly once.
#[test]
fn destroy_from_its_own_callback_is_deferred_until_it_returns() {
    let f = fabric(25007);
    let ctx = Arc::new(AtomicUsize::new(0));
    let calls = Arc::new(AtomicUsize::new(0));
    let (out_tx, out_rx) = mpsc::channel();
    let (cx, c, otx) = (ctx.clone(), calls.clone(), Mutex::new(out_tx));
    let id = f.create_id(PortSpace::Tcp, move |id, _| {
        c.fetch_add(1, Ordering::SeqCst);
        // Events queued behind this one must never be delivered.
        poke(id, 100);
        let r = id.destroy();
        let state = id.state();
        let ctx_now = cx.load(Ordering::SeqCst);
        // A bounded wait from inside the callback returns false rather than deadlocking.
        let h = id.begin_destroy();
        let waited = h.wait_for(Duration::from_millis(20));
        let done = h.is_done();
        otx.lock()
            .unwrap()
            .send((r, state, ctx_now, waited, done))
            .unwrap();
        thread::sleep(Duration::from_millis(50));
        Flow::Continue
    });
    id.set_context(Tracked(ctx.clone()));
    poke(&id, 0);
    let (r, state, ctx_now, waited, done) = out_rx.recv_timeout(T).unwrap();
    assert_eq!(r, Ok(DestroyOutcome::Deferred));
    assert_eq!(state, State::Destroying);
    assert_eq!(ctx_now, 0, "context dropped while its callback ran");
    assert!(!waited && !done, "teardown completed inside the callback");
    let h = id.begin_destroy();
    assert!(h.wait_for(T), "deferred teardown never completed");
    assert_eq!(ctx.load(Ordering::SeqCst), 1);
    assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    thread::sleep(Duration::from_millis(100));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(f.live_ids(), 0);
    f.shutdown();
}

/// Point 4: destroy of id A from inside id B's callback, while A's callback is in flight on
/// another dispatcher thread, returns `Deferred` without waiting for it; no new callback of A
/// starts; A's teardown completes when its callback returns. Destroying an idle id from
/// inside another id's callback completes at once.
#[test]
fn destroy_from_another_ids_callback_does_not_wait_for_it() {
    let f = fabric(25008);
    let gate = Gate::new();
    let a_calls = Arc::new(AtomicUsize::new(0));
    let a_ctx = Arc::new(AtomicUsize::new(0));
    let (entered_tx, entered_rx) = mpsc::channel();
    let (g, c, etx) = (gate.clone(), a_calls.clone(), Mutex::new(entered_tx));
    let a = f.create_id(PortSpace::Tcp, move |_, _| {
        c.fetch_add(1, Ordering::SeqCst);
        etx.lock().unwrap().send(()).unwrap();
        g.wait();
        Flow::Continue
    });
    a.set_context(Tracked(a_ctx.clone()));
    let idle_ctx = Arc::new(AtomicUsize::new(0));
    let idle = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    idle.set_context(Tracked(idle_ctx.clone()));
    let (res_tx, res_rx) = mpsc::channel();
    let (target, idle2, rtx) = (a.clone(), idle.clone(), Mutex::new(res_tx));
    let b = f.create_id(PortSpace::Tcp, move |_, _| {
        let t0 = Instant::now();
        let r = target.destroy();
        let took = t0.elapsed();
        // More events for A after the destroy call: never delivered.
        let _ = target.resolve_addr(None, unreachable_dst(7));
        let r_idle = idle2.destroy();
        rtx.lock().unwrap().send((r, took, r_idle)).unwrap();
        Flow::Continue
    });
    poke(&a, 0);
    entered_rx.recv_timeout(T).unwrap();
    poke(&a, 1);
    poke(&b, 0);
    let (r, took, r_idle) = res_rx
        .recv_timeout(Duration::from_secs(3))
        .expect("destroy from another id's callback blocked on the target's callback");
    assert_eq!(r, Ok(DestroyOutcome::Deferred));
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert_eq!(
        r_idle,
        Ok(DestroyOutcome::Done),
        "an idle target goes at once"
    );
    assert_eq!(idle_ctx.load(Ordering::SeqCst), 1);
    assert_eq!(a.state(), State::Destroying);
    assert_eq!(
        a_ctx.load(Ordering::SeqCst),
        0,
        "A's context went while A ran"
    );
    gate.open();
    assert!(eventually(T, || a_ctx.load(Ordering::SeqCst) == 1));
    assert_eq!(a.destroy(), Ok(DestroyOutcome::Done));
    thread::sleep(Duration::from_millis(100));
    assert_eq!(
        a_calls.load(Ordering::SeqCst),
        1,
        "A got a callback after destroy"
    );
    b.destroy().unwrap();
    assert_eq!(f.live_ids(), 0);
    f.shutdown();
}

// ----- 5. Non-blocking destroy -------------------------------------------------------------

fn block_on<F: Future>(fut: F) -> F::Output {
    struct Unpark(thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Arc::new(Unpark(thread::current())).into();
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    let end = Instant::now() + T;
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        assert!(Instant::now() < end, "future never completed");
        thread::park_timeout(T);
    }
}

/// Point 5: `begin_destroy` returns at once while the callback is in flight; the handle's
/// `is_done`, `wait_for`, `wait` and `.await` all agree and complete when the callback
/// returns (the future is woken, not polled by timeout).
#[test]
fn begin_destroy_handle_wait_wait_for_is_done_and_future() {
    let f = fabric(25009);
    let gate = Gate::new();
    let ctx = Arc::new(AtomicUsize::new(0));
    let (entered_tx, entered_rx) = mpsc::channel();
    let (g, etx) = (gate.clone(), Mutex::new(entered_tx));
    let id = f.create_id(PortSpace::Tcp, move |_, _| {
        etx.lock().unwrap().send(()).unwrap();
        g.wait();
        Flow::Continue
    });
    id.set_context(Tracked(ctx.clone()));
    poke(&id, 0);
    entered_rx.recv_timeout(T).unwrap();
    let t0 = Instant::now();
    let h = id.begin_destroy();
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "begin_destroy blocked"
    );
    assert!(!h.is_done());
    assert!(!h.wait_for(Duration::from_millis(100)));
    assert_eq!(id.state(), State::Destroying);
    let (done_tx, done_rx) = mpsc::channel();
    let awaiting = thread::spawn(move || {
        block_on(h);
        done_tx.send(Instant::now()).unwrap();
    });
    thread::sleep(Duration::from_millis(100));
    assert!(done_rx.try_recv().is_err(), "future completed early");
    let opened = Instant::now();
    gate.open();
    let woke = done_rx.recv_timeout(T).expect("future completes");
    assert!(
        woke.duration_since(opened) < Duration::from_secs(3),
        "the future was not woken"
    );
    awaiting.join().unwrap();
    assert_eq!(ctx.load(Ordering::SeqCst), 1);
    let again = id.begin_destroy();
    assert!(again.is_done());
    assert!(again.wait_for(Duration::ZERO));
    again.wait();
    block_on(again);
    assert_eq!(ctx.load(Ordering::SeqCst), 1);
    assert_eq!(f.live_ids(), 0);
    f.shutdown();
}

// ----- 6. Device removal -------------------------------------------------------------------

/// Point 6: the `DeviceRemoval` event comes after the callback in flight (never during it),
/// exactly once, and after it every operation but destroy fails with `DeviceRemoved`.
#[test]
fn device_removal_comes_after_the_callback_in_flight_once_then_only_destroy() {
    let f = fabric(25005);
    let gate = Gate::new();
    let busy = Arc::new(AtomicBool::new(false));
    let log = Arc::new(Mutex::new(Vec::new()));
    let after = Arc::new(Mutex::new(Vec::new()));
    let (entered_tx, entered_rx) = mpsc::channel();
    let (g, b, l, a, etx) = (
        gate.clone(),
        busy.clone(),
        log.clone(),
        after.clone(),
        Mutex::new(entered_tx),
    );
    let other = EventChannel::new();
    let id = f.create_id(PortSpace::Tcp, move |id, ev| {
        assert!(!b.swap(true, Ordering::SeqCst), "overlapping callbacks");
        l.lock().unwrap().push(ev.name());
        match ev {
            Event::AddrError(_) => {
                etx.lock().unwrap().send(()).unwrap();
                g.wait();
            }
            Event::DeviceRemoval => {
                let mut v = a.lock().unwrap();
                v.push(("bind", id.bind(addr(2, 0))));
                v.push(("resolve_addr", id.resolve_addr(None, addr(2, 1))));
                v.push(("resolve_route", id.resolve_route()));
                v.push(("listen", id.listen(0)));
                v.push(("connect", id.connect(&ConnectOptions::default())));
                v.push(("accept", id.accept(&AcceptOptions::default())));
                v.push(("reject", id.reject(&[])));
                v.push(("establish", id.establish()));
                v.push(("disconnect", id.disconnect()));
                v.push(("create_qp", id.create_qp().map(|_| ())));
                v.push((
                    "init_qp_attr",
                    id.init_qp_attr(rcm::QpState::Init).map(|_| ()),
                ));
                v.push(("migrate", id.migrate(&other)));
            }
            _ => {}
        }
        b.store(false, Ordering::SeqCst);
        Flow::Continue
    });
    id.bind(addr(1, 0)).unwrap();
    poke(&id, 0);
    entered_rx.recv_timeout(T).unwrap();
    let removal = f.remove_device(ip(1)).unwrap();
    assert_eq!(id.state(), State::DeviceRemoval);
    assert_eq!(removal.holding(), vec![id.key()]);
    gate.open();
    assert!(eventually(T, || log.lock().unwrap().len() == 2));
    thread::sleep(Duration::from_millis(100));
    assert_eq!(*log.lock().unwrap(), vec!["ADDR_ERROR", "DEVICE_REMOVAL"]);
    assert_eq!(
        after.lock().unwrap().len(),
        12,
        "every call made from the DEVICE_REMOVAL callback"
    );
    for (op, r) in after.lock().unwrap().iter() {
        assert_eq!(*r, Err(Error::DeviceRemoved), "{op} after DeviceRemoval");
    }
    assert_eq!(id.state(), State::DeviceRemoval);
    assert_eq!(
        removal.wait(Duration::from_millis(100)),
        Err(vec![id.key()])
    );
    assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    removal.wait(T).unwrap();
    assert!(removal.holding().is_empty());
    // The device is gone for good: nothing binds to it any more.
    let late = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    assert_eq!(late.bind(addr(1, 0)), Err(Error::AddrNotAvailable(ip(1))));
    late.destroy().unwrap();
    assert_eq!(f.live_ids(), 0);
    assert_eq!(f.bound_ports(), 0);
    f.shutdown();
}

/// Point 6: the removal reports exactly the ids holding the device until each is destroyed;
/// ids on other devices are untouched.
#[test]
fn removal_completes_only_when_every_id_on_the_device_is_destroyed() {
    let f = fabric(25006);
    let ch = EventChannel::new();
    let removals = Arc::new(AtomicUsize::new(0));
    let r = removals.clone();
    let counting = move |_: &CmId, ev: Event| {
        if matches!(ev, Event::DeviceRemoval) {
            r.fetch_add(1, Ordering::SeqCst);
        }
        Flow::Continue
    };
    let listener = f.create_id(PortSpace::Tcp, counting.clone());
    listener.bind(addr(1, 25106)).unwrap();
    listener.listen(0).unwrap();
    let bound = f.create_id(PortSpace::Udp, counting.clone());
    bound.bind(addr(1, 0)).unwrap();
    let chan = f.create_id_on(PortSpace::Tcp, &ch);
    chan.bind(addr(1, 0)).unwrap();
    let elsewhere = f.create_id(PortSpace::Tcp, counting.clone());
    elsewhere.bind(addr(2, 0)).unwrap();
    let unbound = f.create_id(PortSpace::Tcp, counting);
    let removal = f.remove_device(ip(1)).unwrap();
    assert_eq!(
        f.remove_device(ip(1)).err(),
        Some(Error::AddrNotAvailable(ip(1))),
        "a second removal of the same device"
    );
    let mut want = vec![listener.key(), bound.key(), chan.key()];
    want.sort_unstable();
    let sorted = |mut v: Vec<u64>| {
        v.sort_unstable();
        v
    };
    assert_eq!(sorted(removal.holding()), want);
    assert_eq!(
        removal.wait(Duration::from_millis(100)).map_err(sorted),
        Err(want.clone())
    );
    assert!(eventually(T, || removals.load(Ordering::SeqCst) == 2));
    let e = ch.get_event(Some(T)).unwrap();
    assert!(matches!(e.event(), Event::DeviceRemoval));
    drop(e);
    for id in [&listener, &bound, &chan] {
        assert_eq!(id.state(), State::DeviceRemoval);
        id.destroy().unwrap();
        want.retain(|k| *k != id.key());
        assert_eq!(sorted(removal.holding()), want);
    }
    removal.wait(T).unwrap();
    thread::sleep(Duration::from_millis(100));
    assert_eq!(removals.load(Ordering::SeqCst), 2, "one DeviceRemoval each");
    assert_eq!(elsewhere.state(), State::AddrBound);
    assert_eq!(unbound.state(), State::Idle);
    elsewhere.destroy().unwrap();
    unbound.destroy().unwrap();
    assert_eq!(f.live_ids(), 0);
    assert_eq!(f.bound_ports(), 0);
    f.shutdown();
}

/// Point 6 ("listeners on it stop"): once a device is removed, its listener accepts no new
/// connect request, even before the listener itself is destroyed. A request reaching the
/// removed device's address is refused or goes unanswered; no new id appears on the device
/// (it would hold a device whose removal already completed, and never get a
/// `DeviceRemoval`).
#[test]
fn removed_devices_listener_takes_no_new_connect_requests() {
    let f = fabric(25014);
    let srv = EventChannel::new();
    let listener = f.create_id_on(PortSpace::Tcp, &srv);
    listener.bind(addr(1, 7000)).unwrap();
    listener.listen(0).unwrap();
    let removal = f.remove_device(ip(1)).unwrap();
    // The listener has not consumed its DeviceRemoval yet (so it is not destroyed).
    let cli = EventChannel::new();
    let (client, r) = dialed(&f, &cli, None, addr(1, 7000));
    r.unwrap();
    let (who, outcome) = next(&cli);
    assert_eq!(who, client);
    assert!(
        matches!(outcome, Event::Rejected { .. } | Event::Unreachable(_)),
        "the client got {outcome:?} from a removed device's listener"
    );
    let mut on_srv = Vec::new();
    while let Some(mut e) = srv.get_event(Some(Duration::from_millis(200))) {
        on_srv.push((e.id().key(), e.take().map(|ev| ev.name())));
    }
    assert_eq!(
        on_srv,
        vec![(listener.key(), Some("DEVICE_REMOVAL"))],
        "events on the removed device's listener channel"
    );
    assert_eq!(f.live_ids(), 2, "only the listener and the client exist");
    listener.destroy().unwrap();
    removal.wait(T).unwrap();
    client.destroy().unwrap();
    assert_eq!(f.live_ids(), 0);
    f.shutdown();
}

/// Point 6 ("after it, the only valid operation on the id is destroy"): once an id got its
/// `DeviceRemoval`, protocol traffic still arriving for it (here the peer's DREQ, which the
/// removed device still receives until the removal completes) neither changes its state
/// nor delivers any further event.
#[test]
fn no_event_and_no_state_change_after_device_removal() {
    let f = fabric(25015);
    let p = channel_pair(&f, 7000);
    let removal = f.remove_device(ip(1)).unwrap();
    let mut removed = Vec::new();
    for _ in 0..2 {
        let (id, ev) = next(&p.srv);
        assert!(matches!(ev, Event::DeviceRemoval), "{ev:?}");
        removed.push(id.key());
    }
    removed.sort_unstable();
    let mut want = vec![p.listener.key(), p.child.key()];
    want.sort_unstable();
    assert_eq!(removed, want);
    assert_eq!(p.child.state(), State::DeviceRemoval);
    // The peer (on the surviving device) disconnects; its DREQ reaches the removed device.
    p.client.disconnect().unwrap();
    expect_ev(&p.cli, &p.client, "DISCONNECTED");
    let late: Vec<_> = std::iter::from_fn(|| {
        p.srv
            .get_event(Some(Duration::from_millis(300)))
            .map(|mut e| (e.id().key(), e.take().map(|ev| ev.name())))
    })
    .collect();
    assert_eq!(late, vec![], "events after DeviceRemoval");
    assert_eq!(
        p.child.state(),
        State::DeviceRemoval,
        "the state changed after DeviceRemoval"
    );
    assert_eq!(p.child.disconnect(), Err(Error::DeviceRemoved));
    p.child.destroy().unwrap();
    p.listener.destroy().unwrap();
    removal.wait(T).unwrap();
    p.client.destroy().unwrap();
    f.shutdown();
}

/// Point 6: a device whose removal completed can be added again at the same address (a
/// hot-unplugged port that comes back), and it works.
#[test]
fn device_can_be_added_again_after_its_removal() {
    let f = fabric(25016);
    f.remove_device(ip(2)).unwrap().wait(T).unwrap();
    assert_eq!(f.device_addrs(), vec![ip(1)]);
    f.add_device(ip(2))
        .expect("re-adding a removed device's address");
    let p = channel_pair(&f, 7000);
    assert_eq!(p.client.device_addr(), Some(ip(2)));
    for id in [p.client, p.child, p.listener] {
        id.destroy().unwrap();
    }
    f.shutdown();
}

/// A device added again after its removal does not replay the comm IDs and CA GUID of
/// another device: a peer knows a connection by that pair, and takes a REQ repeating it for a
/// duplicate of the connection it names (from another address: dropped). Before, the GUID
/// and the engine's seed came from the number of devices, so removing 127.0.0.2 of three and
/// adding it again gave it 127.0.0.3's.
#[test]
fn a_device_added_again_does_not_replay_another_devices_comm_ids() {
    let f = Fabric::loopback_with(3, config(25051)).unwrap();
    f.remove_device(ip(2)).unwrap().wait(T).unwrap();
    f.add_device(ip(2)).unwrap();
    let (srv, cli) = (EventChannel::new(), EventChannel::new());
    let listener = f.create_id_on(PortSpace::Tcp, &srv);
    listener.bind(addr(1, 7000)).unwrap();
    listener.listen(0).unwrap();
    let mut ids = vec![];
    // The first connect of each device: the same comm ID and GUID before.
    for src in [3, 2] {
        let (client, r) = dialed(&f, &cli, Some(ip(src)), addr(1, 7000));
        r.unwrap();
        assert_eq!(client.device_addr(), Some(ip(src)));
        let (child, ev) = next(&srv);
        assert!(
            matches!(ev, Event::ConnectRequest { .. }),
            "from 127.0.0.{src}: {ev:?}"
        );
        child.accept(&AcceptOptions::default()).unwrap();
        expect_ev(&cli, &client, "CONNECT_RESPONSE");
        ids.extend([client, child]);
    }
    ids.push(listener);
    for id in ids {
        id.destroy().unwrap();
    }
    f.shutdown();
}

/// A removal dropped before it completed completes by itself once its ids are destroyed:
/// the device stops and its address can be added again. Before, only `wait` stopped it: its
/// thread and socket stayed, and adding the address again failed (the port in use).
#[test]
fn a_removal_dropped_unfinished_completes_once_its_ids_are_gone() {
    let f = fabric(25053);
    let ch = EventChannel::new();
    let id = f.create_id_on(PortSpace::Tcp, &ch);
    id.bind(addr(2, 7000)).unwrap();
    let r = f.remove_device(ip(2)).unwrap();
    assert_eq!(r.wait(Duration::from_millis(20)), Err(vec![id.key()]));
    drop(r);
    expect_ev(&ch, &id, "DEVICE_REMOVAL");
    id.destroy().unwrap();
    let end = Instant::now() + T;
    loop {
        match f.add_device(ip(2)) {
            Ok(_) => break,
            Err(e) if Instant::now() < end => {
                let _ = e;
                thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("127.0.0.2 not free {T:?} after its last id went: {e}"),
        }
    }
    let p = channel_pair(&f, 7001);
    for id in [p.client, p.child, p.listener] {
        id.destroy().unwrap();
    }
    f.shutdown();
}

/// A connect whose device is removed while it runs fails as a call on a removed device
/// does (`DeviceRemoved`), not as one on a destroyed id: the id is not destroyed, it has its
/// DEVICE_REMOVAL to come, and the application must still destroy it. The removal is made
/// by the listener's callback, which may run inside the connect (a datagram to the device's
/// own address goes straight to its engine) or after it, on the device's thread: tried
/// until it ran inside some times.
#[test]
fn a_connect_whose_device_is_removed_meanwhile_says_device_removed() {
    let (mut inside, mut tries) = (0, 0);
    while inside < 3 && tries < 500 {
        tries += 1;
        let f = Fabric::loopback_with(
            1,
            rcm::FabricConfig {
                callbacks: rcm::CallbackMode::Inline,
                loopback: true,
                ..config(25054)
            },
        )
        .unwrap();
        let removal = Arc::new(Mutex::new(None));
        let (fc, rc) = (f.clone(), removal.clone());
        let listener = f.create_id(PortSpace::Tcp, move |_, ev| {
            if matches!(ev, Event::ConnectRequest { .. }) {
                *rc.lock().unwrap() = Some(fc.remove_device(ip(1)).unwrap());
                return Flow::Destroy;
            }
            Flow::Continue
        });
        listener.bind(addr(1, 7000)).unwrap();
        listener.listen(0).unwrap();
        let ch = EventChannel::new();
        let (client, r) = dialed(&f, &ch, None, addr(1, 7000));
        if removal.lock().unwrap().is_some() {
            inside += 1;
            assert!(matches!(r, Err(Error::DeviceRemoved)), "{r:?}");
        }
        expect_ev(&ch, &client, "DEVICE_REMOVAL");
        client.destroy().unwrap();
        listener.destroy().unwrap();
        let r = removal
            .lock()
            .unwrap()
            .take()
            .expect("the listener's callback ran");
        r.wait(T).unwrap();
        f.shutdown();
    }
    assert!(
        inside > 0,
        "the listener's callback never ran inside the connect in {tries} tries"
    );
}

/// A timeout of `Duration::MAX` (what a caller writes for "for ever") waits for ever, where
/// each of these panicked adding it to the clock: a channel's `get_event`, `DestroyHandle::
/// wait_for`, `Removal::wait`, `rcm::spin_until`.
#[test]
fn waits_given_duration_max_wait_instead_of_panicking() {
    let f = fabric(25056);
    let ch = EventChannel::new();
    let id = f.create_id_on(PortSpace::Tcp, &ch);
    id.bind(addr(2, 7000)).unwrap();
    thread::scope(|s| {
        s.spawn(|| {
            thread::sleep(Duration::from_millis(20));
            poke(&id, 5);
        });
        let mut ev = ch.get_event(Some(Duration::MAX)).expect("the event");
        assert_eq!(ev.take().as_ref().and_then(seq_of), Some(5));
    });
    let removal = f.remove_device(ip(2)).unwrap();
    expect_ev(&ch, &id, "DEVICE_REMOVAL");
    assert!(id.begin_destroy().wait_for(Duration::MAX));
    assert_eq!(removal.wait(Duration::MAX), Ok(()));
    assert!(rcm::spin_until(Duration::MAX, || true));
    f.shutdown();
}

/// A wildcard listener's `listen` called again (refused: it listens already) while devices
/// are being added: adding a device takes the fabric's listen lock and then each wildcard
/// listener's call lock, so `listen` must take them in that order too, or both wait for
/// ever.
#[test]
fn listen_again_racing_device_additions_does_not_deadlock() {
    let f = Fabric::new(config(25023));
    f.add_device(ip(1)).unwrap();
    let l = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    l.bind(SocketAddr::new(IpAddr::from([0, 0, 0, 0]), 7000))
        .unwrap();
    l.listen(0).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (started, calling) = std::sync::mpsc::channel();
    let again = {
        let (l, stop) = (l.clone(), stop.clone());
        thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                assert_eq!(l.listen(0), Err(Error::InvalidState(State::Listen)));
                if n == 0 {
                    let _ = started.send(());
                }
                n += 1;
            }
            n
        })
    };
    // The additions start once the calls do: on a loaded machine they could otherwise all
    // be over before the calling thread first runs, and nothing would race.
    calling
        .recv_timeout(T)
        .expect("the first listen call returned");
    let adds = within(T, {
        let f = f.clone();
        move || {
            for last in 10..60u8 {
                f.add_device(ip(last)).expect("add a device");
            }
        }
    });
    stop.store(true, Ordering::SeqCst);
    assert!(adds.is_some(), "adding devices hung against listen");
    let calls = within(T, move || again.join().expect("the listen thread"));
    assert!(calls.is_some(), "listen hung");
    assert_eq!(l.state(), State::Listen);
    l.destroy().unwrap();
    f.shutdown();
}

// ----- 7. Channel mode ---------------------------------------------------------------------

/// Point 7: a held channel event keeps its id; a blocking destroy then fails with
/// `EventsOutstanding(n)` and changes nothing (state, queued events, context); once the
/// events are acked it succeeds. A non-blocking destroy completes when the last is acked.
#[test]
fn held_channel_events_refuse_a_blocking_destroy_and_change_nothing() {
    let f = fabric(25010);
    let ch = EventChannel::new();
    let ctx = Arc::new(AtomicUsize::new(0));
    let id = f.create_id_on(PortSpace::Tcp, &ch);
    id.set_context(Tracked(ctx.clone()));
    for n in 0..3 {
        poke(&id, n);
    }
    let e0 = ch.get_event(Some(T)).unwrap();
    assert_eq!(e0.id(), &id);
    assert_eq!(id.destroy(), Err(Error::EventsOutstanding(1)));
    assert_eq!(id.state(), State::Idle);
    assert_eq!(ch.pending(), 2, "the refused destroy purged queued events");
    assert_eq!(ctx.load(Ordering::SeqCst), 0);
    let e1 = ch.get_event(Some(T)).unwrap();
    assert_eq!(seq_of(e1.event()), Some(1), "order kept");
    assert_eq!(id.destroy(), Err(Error::EventsOutstanding(2)));
    assert_eq!(id.with_context(|_: &Tracked| ()), Some(()));
    drop(e0);
    drop(e1);
    assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    assert_eq!(ctx.load(Ordering::SeqCst), 1);
    assert!(
        ch.get_event(Some(Duration::from_millis(100))).is_none(),
        "a destroyed id's queued event was delivered"
    );

    // Non-blocking: completes when the held event is acked.
    let ctx2 = Arc::new(AtomicUsize::new(0));
    let id2 = f.create_id_on(PortSpace::Tcp, &ch);
    id2.set_context(Tracked(ctx2.clone()));
    poke(&id2, 0);
    let held = ch.get_event(Some(T)).unwrap();
    let h = id2.begin_destroy();
    assert!(!h.wait_for(Duration::from_millis(100)));
    assert_eq!(f.live_ids(), 1, "the held event keeps the id");
    assert_eq!(held.id(), &id2);
    assert_eq!(ctx2.load(Ordering::SeqCst), 0);
    drop(held);
    assert!(h.is_done());
    assert_eq!(ctx2.load(Ordering::SeqCst), 1);
    assert_eq!(f.live_ids(), 0);
    f.shutdown();
}

/// Point 7/2: destroying a channel-mode id discards its queued events while other ids on the
/// same channel keep theirs, in order.
#[test]
fn destroy_discards_only_that_ids_queued_channel_events() {
    let f = fabric(25011);
    let ch = EventChannel::new();
    let a = f.create_id_on(PortSpace::Tcp, &ch);
    let b = f.create_id_on(PortSpace::Tcp, &ch);
    for n in 0..4 {
        poke(&a, n);
        poke(&b, 10 + n);
    }
    assert_eq!(a.destroy(), Ok(DestroyOutcome::Done));
    let mut got = Vec::new();
    while let Some(e) = ch.get_event(Some(Duration::from_millis(100))) {
        assert_eq!(e.id(), &b);
        got.push(seq_of(e.event()).unwrap());
    }
    assert_eq!(got, vec![10, 11, 12, 13]);
    b.destroy().unwrap();
    f.shutdown();
}

/// Point 7/2, the channel's index of queued events by id: ids destroyed with events at the
/// front, in the middle and at the back of the queue, around events taken, leave the others'
/// events in order and the count of pending events right; the queue keeps working after.
#[test]
fn destroys_anywhere_in_a_channels_queue_keep_the_rest_in_order() {
    let f = fabric(25031);
    let ch = EventChannel::new();
    let ids: Vec<_> = (0..4)
        .map(|_| f.create_id_on(PortSpace::Tcp, &ch))
        .collect();
    // Round-robin: id k gets 10k, 10k+1, 10k+2.
    for n in 0..3 {
        for (k, id) in ids.iter().enumerate() {
            poke(id, 10 * k as u32 + n);
        }
    }
    assert_eq!(ch.pending(), 12);
    let [a, b, c, d] = <[_; 4]>::try_from(ids).expect("four ids");
    assert_eq!(b.destroy(), Ok(DestroyOutcome::Done));
    assert_eq!(ch.pending(), 9);
    let first = ch.get_event(Some(T)).expect("event");
    assert_eq!((first.id(), seq_of(first.event())), (&a, Some(0)));
    drop(first);
    assert_eq!(a.destroy(), Ok(DestroyOutcome::Done));
    assert_eq!(ch.pending(), 6);
    poke(&c, 23);
    poke(&d, 33);
    let mut got = Vec::new();
    while let Some(e) = ch.get_event(Some(Duration::from_millis(100))) {
        got.push(seq_of(e.event()).unwrap());
        if got.len() == 4 {
            drop(e);
            assert_eq!(ch.pending(), 4);
            assert_eq!(d.destroy(), Ok(DestroyOutcome::Done));
            assert_eq!(ch.pending(), 2);
        }
    }
    assert_eq!(got, vec![20, 30, 21, 31, 22, 23]);
    poke(&c, 24);
    let last = ch.get_event(Some(T)).expect("event");
    assert_eq!(seq_of(last.event()), Some(24));
    drop(last);
    assert_eq!(ch.pending(), 0);
    c.destroy().unwrap();
    f.shutdown();
}

// ----- 11. Migration -----------------------------------------------------------------------

/// Point 11: migrating moves queued events to the new channel in order; an event held from
/// the old channel stays valid and acks to the id; new events go to the new channel.
#[test]
fn migrate_moves_queued_events_in_order_and_held_events_stay_valid() {
    let f = fabric(25012);
    let (a, b) = (EventChannel::new(), EventChannel::new());
    let id = f.create_id_on(PortSpace::Tcp, &a);
    for n in 0..3 {
        poke(&id, n);
    }
    let held = a.get_event(Some(T)).unwrap();
    id.migrate(&b).unwrap();
    assert_eq!(id.destroy(), Err(Error::EventsOutstanding(1)));
    poke(&id, 3);
    assert_eq!(a.pending(), 0);
    let got: Vec<u32> = (0..3)
        .map(|_| seq_of(b.get_event(Some(T)).unwrap().event()).unwrap())
        .collect();
    assert_eq!(got, vec![1, 2, 3]);
    assert_eq!(seq_of(held.event()), Some(0));
    drop(held);
    // Migrating to the channel it is on is a no-op; a callback-mode id cannot migrate.
    id.migrate(&b).unwrap();
    let cb = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    assert!(matches!(cb.migrate(&b), Err(Error::InvalidArgument(_))));
    assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    cb.destroy().unwrap();
    f.shutdown();
}

/// A listener migrated with connect requests not yet taken takes them along (ucma queues a
/// request as its listener's event, and `ucma_migrate_id` moves it): the requests come on
/// the new channel, nothing is left on the old one, and one arriving after the migrate comes
/// there too. A request already taken on the old channel stays the application's there.
/// Before, each request stayed on the old channel (queued on its child, which had taken
/// the listener's channel when it was made), and held its backlog place.
#[test]
fn a_migrated_listener_takes_its_untaken_connect_requests_along() {
    let f = fabric(25057);
    let (a, b, cli) = (
        EventChannel::new(),
        EventChannel::new(),
        EventChannel::new(),
    );
    let listener = f.create_id_on(PortSpace::Tcp, &a);
    listener.bind(addr(1, 7000)).unwrap();
    listener.listen(0).unwrap();
    let dial = || {
        let (c, r) = dialed(&f, &cli, None, addr(1, 7000));
        r.unwrap();
        c
    };
    let mut clients = vec![dial(), dial(), dial()];
    // The first taken on the old channel (it stays there); two more queued.
    let taken = a.get_event(Some(T)).unwrap();
    assert!(matches!(taken.event(), Event::ConnectRequest { .. }));
    let end = Instant::now() + T;
    while a.pending() < 2 && Instant::now() < end {
        thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(a.pending(), 2);
    listener.migrate(&b).unwrap();
    assert_eq!(a.pending(), 0, "requests left on the old channel");
    clients.push(dial());
    let mut children = vec![taken.id().clone()];
    drop(taken);
    for n in 0..3 {
        let (child, ev) = next(&b);
        assert!(
            matches!(ev, Event::ConnectRequest { .. }),
            "request {n}: {ev:?}"
        );
        children.push(child);
    }
    assert!(a.get_event(Some(Duration::from_millis(50))).is_none());
    for c in children.iter().chain(&clients) {
        c.destroy().unwrap();
    }
    listener.destroy().unwrap();
    f.shutdown();
}

/// A connect request held (taken, not yet dropped) holds its listener, not the child it
/// names: the child may be rejected and destroyed before the request is acked, as
/// librdmacm allows (ucma counts the request among the listener's events reported, so
/// rdma_destroy_id on the child does not wait for it). Before, the child's blocking destroy
/// was refused (`EventsOutstanding`), and code that ignored that leaked it.
#[test]
fn a_held_connect_request_holds_its_listener_not_its_child() {
    let f = fabric(25058);
    let (srv, cli) = (EventChannel::new(), EventChannel::new());
    let listener = f.create_id_on(PortSpace::Tcp, &srv);
    listener.bind(addr(1, 7000)).unwrap();
    listener.listen(0).unwrap();
    let (client, r) = dialed(&f, &cli, None, addr(1, 7000));
    r.unwrap();
    let req = srv.get_event(Some(T)).unwrap();
    assert!(matches!(req.event(), Event::ConnectRequest { .. }));
    let child = req.id().clone();
    child.reject(b"no").unwrap();
    assert_eq!(child.destroy(), Ok(DestroyOutcome::Done));
    assert_eq!(listener.destroy(), Err(Error::EventsOutstanding(1)));
    drop(req);
    expect_ev(&cli, &client, "REJECTED");
    assert_eq!(listener.destroy(), Ok(DestroyOutcome::Done));
    client.destroy().unwrap();
    f.shutdown();
}

fn spin(units: u32) {
    for _ in 0..units {
        std::hint::spin_loop();
    }
}

/// Point 11: an event produced while the id migrates lands on the channel the id ends up on
/// — never stranded on the old one after `migrate` returned (where a reader of the new
/// channel would never see it, and the id's order would be broken). The two sides start
/// each round together (spinning, not parking) and their relative timing sweeps a few
/// microseconds across rounds.
#[test]
fn migrate_racing_event_delivery_never_strands_an_event() {
    const ROUNDS: u32 = 20000;
    const MARK: u32 = 0x8000;
    let f = fabric(25013);
    let chans = [EventChannel::new(), EventChannel::new()];
    let id = f.create_id_on(PortSpace::Tcp, &chans[0]);
    let started = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let pushed = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let (pid, st, pu) = (id.clone(), started.clone(), pushed.clone());
    let producer = thread::spawn(move || {
        for n in 1..=ROUNDS {
            let mut spins = 0u32;
            loop {
                match st.load(Ordering::SeqCst) {
                    u32::MAX => return,
                    s if s == n => break,
                    _ => {}
                }
                spins += 1;
                if spins % 4096 == 0 {
                    thread::yield_now();
                }
                std::hint::spin_loop();
            }
            spin(n % 61);
            poke(&pid, n);
            pu.store(n, Ordering::SeqCst);
        }
    });
    // A reader of the id's state takes the slot's lock over and over, which stretches the
    // gap between a push choosing its channel and queueing on it.
    let hammer_stop = Arc::new(AtomicBool::new(false));
    let (hid, hs) = (id.clone(), hammer_stop.clone());
    let hammer = thread::spawn(move || {
        while !hs.load(Ordering::SeqCst) {
            for _ in 0..64 {
                let _ = hid.state();
            }
            thread::yield_now();
        }
    });
    let mut cur = 0;
    let mut stranded = Vec::new();
    let budget = Instant::now() + Duration::from_secs(5);
    let mut rounds = 0;
    for n in 1..=ROUNDS {
        if Instant::now() > budget || !stranded.is_empty() {
            break;
        }
        rounds = n;
        let to = 1 - cur;
        started.store(n, Ordering::SeqCst);
        spin((n / 61) % 67);
        id.migrate(&chans[to]).unwrap();
        let end = Instant::now() + T;
        let mut spins = 0u32;
        while pushed.load(Ordering::SeqCst) != n {
            assert!(Instant::now() < end, "producer stuck");
            spins += 1;
            if spins % 4096 == 0 {
                thread::yield_now();
            }
            std::hint::spin_loop();
        }
        poke(&id, MARK + n);
        let first = seq_of(chans[to].get_event(Some(T)).unwrap().event()).unwrap();
        if first == n {
            let second = seq_of(chans[to].get_event(Some(T)).unwrap().event()).unwrap();
            assert_eq!(second, MARK + n);
        } else {
            assert_eq!(first, MARK + n);
            let old = chans[cur]
                .get_event(Some(Duration::ZERO))
                .and_then(|e| seq_of(e.event()));
            stranded.push((n, old));
        }
        cur = to;
    }
    started.store(u32::MAX, Ordering::SeqCst);
    hammer_stop.store(true, Ordering::SeqCst);
    producer.join().unwrap();
    hammer.join().unwrap();
    assert!(
        stranded.is_empty(),
        "{} of {rounds} events pushed during a migrate stayed on the old channel after it \
         returned (round, found on old channel): {:?}",
        stranded.len(),
        &stranded[..stranded.len().min(10)]
    );
    id.destroy().unwrap();
    f.shutdown();
}

// ----- 2/3. Contexts -----------------------------------------------------------------------

/// Point 2: each context value is dropped exactly once: a replaced context at once, the last
/// one after the last callback (also when the id destroys itself with `Flow::Destroy`).
#[test]
fn context_is_dropped_exactly_once_after_the_last_callback() {
    let f = fabric(25017);
    let first = Arc::new(AtomicUsize::new(0));
    let second = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = mpsc::channel();
    let (s, ttx) = (second.clone(), Mutex::new(tx));
    let id = f.create_id(PortSpace::Tcp, move |id, _| {
        let seen = id.with_context(|t: &Tracked| Arc::ptr_eq(&t.0, &s));
        ttx.lock()
            .unwrap()
            .send((seen, s.load(Ordering::SeqCst)))
            .unwrap();
        thread::sleep(Duration::from_millis(50));
        Flow::Destroy
    });
    id.set_context(Tracked(first.clone()));
    id.set_context(Tracked(second.clone()));
    assert_eq!(
        first.load(Ordering::SeqCst),
        1,
        "a replaced context is dropped"
    );
    assert_eq!(id.with_context(|_: &u32| ()), None, "wrong type");
    poke(&id, 0);
    poke(&id, 1);
    assert_eq!(rx.recv_timeout(T), Ok((Some(true), 0)));
    assert!(eventually(T, || second.load(Ordering::SeqCst) == 1));
    thread::sleep(Duration::from_millis(100));
    assert!(rx.try_recv().is_err(), "a callback after Flow::Destroy");
    assert_eq!(first.load(Ordering::SeqCst), 1);
    assert_eq!(second.load(Ordering::SeqCst), 1);
    assert_eq!(f.live_ids(), 0);
    f.shutdown();
}

// ----- 9. Resolution events vs destroy -----------------------------------------------------

/// Point 9: resolution work queued for an id never reaches it once it is destroyed, whether
/// the destroy comes right after the call or while the dispatcher is busy with other ids.
#[test]
fn resolution_results_are_cancelled_by_destroy() {
    let mut cfg = config(25018);
    cfg.dispatcher_threads = 1;
    let f = Fabric::loopback_with(2, cfg).unwrap();
    // Occupy the only dispatcher thread so the resolution events stay queued.
    let (blocker, gate) = busy_callback(&f);
    let calls = Arc::new(AtomicUsize::new(0));
    let mut ids = Vec::new();
    for _ in 0..20 {
        let c = calls.clone();
        let id = f.create_id(PortSpace::Tcp, move |_, _| {
            c.fetch_add(1, Ordering::SeqCst);
            Flow::Continue
        });
        id.resolve_addr(None, addr(1, 7000)).unwrap();
        id.resolve_route().unwrap();
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
        ids.push(id);
    }
    gate.open();
    thread::sleep(Duration::from_millis(200));
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    blocker.destroy().unwrap();

    // Without the blocker: destroy at arbitrary points of a resolve chain driven by the
    // callbacks; nothing runs after destroy returned, however late it would come (each
    // round's count is checked after all rounds and a quiet period).
    let mut lates = Vec::new();
    for n in 0..100u32 {
        let destroyed = Arc::new(AtomicBool::new(false));
        let late = Arc::new(AtomicUsize::new(0));
        lates.push(late.clone());
        let (d, l) = (destroyed.clone(), late.clone());
        let id = f.create_id(PortSpace::Tcp, move |id, ev| {
            if d.load(Ordering::SeqCst) {
                l.fetch_add(1, Ordering::SeqCst);
            }
            if matches!(ev, Event::AddrResolved) {
                let _ = id.resolve_route();
            }
            Flow::Continue
        });
        id.resolve_addr(None, addr(1, 7000)).unwrap();
        if n % 2 == 0 {
            thread::yield_now();
        }
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
        destroyed.store(true, Ordering::SeqCst);
    }
    assert_no_late_callbacks(&lates);
    assert_eq!(f.live_ids(), 0);
    assert_eq!(f.bound_ports(), 0);
    f.shutdown();
}

// ----- Shutdown ----------------------------------------------------------------------------

/// `Fabric::shutdown` destroys ids in every state (listening, connected, resolving, bound,
/// idle, channel-mode with queued events) and leaves no id, port or context behind.
#[test]
fn shutdown_destroys_every_id_and_drops_every_context_once() {
    let f = fabric(25019);
    let p = channel_pair(&f, 7000);
    let drops = Arc::new(AtomicUsize::new(0));
    for id in [&p.listener, &p.client, &p.child] {
        id.set_context(Tracked(drops.clone()));
    }
    let bound = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    bound.bind(addr(2, 0)).unwrap();
    bound.set_context(Tracked(drops.clone()));
    let resolved = f.create_id_on(PortSpace::Tcp, &p.cli);
    resolved.resolve_addr(None, addr(1, 7000)).unwrap();
    resolved.set_context(Tracked(drops.clone()));
    let idle = f.create_id(PortSpace::Udp, |_, _| Flow::Continue);
    idle.set_context(Tracked(drops.clone()));
    assert_eq!(f.live_ids(), 6);
    f.shutdown();
    assert_eq!(f.live_ids(), 0);
    assert_eq!(f.bound_ports(), 0);
    assert_eq!(drops.load(Ordering::SeqCst), 6);
    for id in [&p.listener, &p.client, &p.child, &bound, &resolved, &idle] {
        assert_eq!(id.state(), State::Destroying);
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    assert!(p.srv.get_event(Some(Duration::from_millis(50))).is_none());
    assert_eq!(drops.load(Ordering::SeqCst), 6);
    // A shut-down fabric makes no ids or devices: an id made after is born destroyed (its
    // calls fail, destroy works), the fallible forms say why.
    let after = within(T, {
        let f = f.clone();
        move || {
            let id = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
            let r = id.bind(addr(1, 0));
            (r, id.destroy())
        }
    })
    .expect("an id made after shutdown hung");
    assert_eq!(after, (Err(Error::Destroyed), Ok(DestroyOutcome::Done)));
    let ch = EventChannel::new();
    assert_eq!(
        f.try_create_id_on(PortSpace::Tcp, &ch).err(),
        Some(Error::ShutDown)
    );
    assert_eq!(f.add_device(ip(3)).err(), Some(Error::ShutDown));
    assert_eq!(f.live_ids(), 0);
}

/// Ids made while a shutdown runs: each is either among those it destroys or refused
/// (`ShutDown`); none is left usable, with no device under it and events that would never
/// come. (Before the shutdown state, an id published after the shutdown's walk of the id
/// table survived it.)
#[test]
fn ids_made_during_a_shutdown_do_not_outlive_it() {
    for round in 0..20 {
        let f = fabric(25028);
        let stop = Arc::new(AtomicBool::new(false));
        let makers: Vec<_> = (0..3)
            .map(|_| {
                let f = f.clone();
                let stop = stop.clone();
                thread::spawn(move || {
                    let ch = EventChannel::new();
                    let mut made = Vec::new();
                    while !stop.load(Ordering::SeqCst) {
                        match f.try_create_id_on(PortSpace::Tcp, &ch) {
                            Ok(id) => made.push(id),
                            Err(e) => {
                                assert_eq!(e, Error::ShutDown);
                                break;
                            }
                        }
                    }
                    made
                })
            })
            .collect();
        thread::sleep(Duration::from_millis(5));
        f.shutdown();
        stop.store(true, Ordering::SeqCst);
        for m in makers {
            for id in m.join().expect("maker") {
                assert_eq!(
                    id.bind(addr(2, 0)),
                    Err(Error::Destroyed),
                    "round {round}: an id outlived the shutdown"
                );
            }
        }
        assert_eq!(f.live_ids(), 0, "round {round}");
    }
}

/// Dropping the last `Fabric` handle shuts the fabric down, as `shutdown` does: a clone keeps
/// it running; once every handle is gone, an id the application still holds is destroyed
/// (its peer in another fabric sees DISCONNECTED), its calls fail, and the device's UDP
/// port is free again.
#[test]
fn dropping_the_last_fabric_handle_shuts_it_down() {
    let port = 25021;
    let (server, client_f) = two_fabrics(port);
    let Pair {
        srv, client, child, ..
    } = channel_pair_across(&server, &client_f, 7000);

    let clone = client_f.clone();
    drop(client_f);
    assert!(
        std::net::UdpSocket::bind(addr(2, port)).is_err(),
        "a remaining handle keeps the device (and its port)"
    );
    assert_eq!(client.state(), State::Established);
    assert!(srv.get_event(Some(Duration::from_millis(100))).is_none());

    drop(clone);
    expect_ev(&srv, &child, "DISCONNECTED");
    assert_eq!(client.state(), State::Destroying);
    assert!(client.disconnect().is_err());
    assert_eq!(client.destroy(), Ok(DestroyOutcome::Done));
    assert!(
        std::net::UdpSocket::bind(addr(2, port)).is_ok(),
        "the device's port is released"
    );
    server.shutdown();
}

/// A shutdown while the application holds an event of a connected id: the id is torn down
/// at once (its peer in another fabric sees DISCONNECTED), not at the event's ack, when the
/// devices had stopped and its DREQ could not leave (the peer kept its end up for good).
#[test]
fn shutdown_with_an_event_held_still_disconnects_the_peer() {
    let (server, client_f) = two_fabrics(25064);
    let (
        Pair {
            srv,
            listener,
            client,
            child,
            ..
        },
        held,
    ) = channel_pair_holding(&server, &client_f, 7001);
    client_f.shutdown();
    expect_ev(&srv, &child, "DISCONNECTED");
    assert!(
        matches!(held.event(), Event::Established { .. }),
        "still readable"
    );
    drop(held);
    assert_eq!(client.destroy(), Ok(DestroyOutcome::Done));
    for id in [child, listener] {
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    server.shutdown();
}

/// The last handle may be dropped by the fabric's own thread: here it lives in a callback
/// whose id destroys itself (`Flow::Destroy`), so the dispatcher thread drops it. The
/// fabric still shuts down (its port is released, another id is destroyed) and nothing hangs.
#[test]
fn last_fabric_handle_dropped_by_a_callback_shuts_it_down() {
    let port = 25022;
    let f = fabric(port);
    let other = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    other.bind(addr(1, 0)).unwrap();
    let held = f.clone();
    let id = f.create_id(PortSpace::Tcp, move |_, ev| {
        let _keep = &held;
        match ev {
            Event::AddrResolved => Flow::Destroy,
            _ => Flow::Continue,
        }
    });
    drop(f);
    assert!(
        std::net::UdpSocket::bind(addr(1, port)).is_err(),
        "the callback's handle keeps the fabric"
    );
    id.resolve_addr(None, addr(2, 7000)).unwrap();
    assert!(
        eventually(T, || std::net::UdpSocket::bind(addr(1, port)).is_ok()),
        "the fabric was not shut down"
    );
    assert!(eventually(T, || other.state() == State::Destroying));
    assert_eq!(other.destroy(), Ok(DestroyOutcome::Done));
}

/// An id whose callback, once running (it is started here), waits until the returned
/// sender says go (or `T` passes): a callback thread waiting for the test's thread.
fn waiting_callback(f: &Fabric) -> (CmId, mpsc::Sender<()>) {
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = Mutex::new(go_rx);
    let (in_tx, in_rx) = mpsc::channel::<()>();
    let b = f.create_id(PortSpace::Tcp, move |_, ev| {
        if matches!(ev, Event::AddrResolved) {
            let _ = in_tx.send(());
            let _ = go_rx.lock().expect("go").recv_timeout(T);
        }
        Flow::Continue
    });
    b.resolve_addr(None, addr(1, 7000)).unwrap();
    in_rx.recv_timeout(T).expect("the waiting callback runs");
    (b, go_tx)
}

/// `Fabric::shutdown` called from a callback while another callback waits for that first
/// one to go on: the shutdown must not wait for the callback threads there (it would wait
/// for the waiting callback, which waits for it). It returns at once and completes on a
/// thread of its own.
#[test]
fn shutdown_from_a_callback_while_another_waits_for_it() {
    let port = 25024;
    let f = fabric(port);
    let (b, go_tx) = waiting_callback(&f);
    let f2 = f.clone();
    let returned = Arc::new(AtomicBool::new(false));
    let r2 = returned.clone();
    let a = f.create_id(PortSpace::Tcp, move |_, ev| {
        if matches!(ev, Event::AddrResolved) {
            f2.shutdown();
            r2.store(true, Ordering::SeqCst);
            let _ = go_tx.send(());
        }
        Flow::Continue
    });
    a.resolve_addr(None, addr(1, 7000)).unwrap();
    // b's callback gives up waiting after T: well before that, shutdown must have returned.
    assert!(
        eventually(Duration::from_secs(2), || returned.load(Ordering::SeqCst)),
        "shutdown in a callback waited for the other callback"
    );
    assert!(
        eventually(T, || std::net::UdpSocket::bind(addr(1, port)).is_ok()),
        "the shutdown did not complete"
    );
    assert!(eventually(T, || a.state() == State::Destroying
        && b.state() == State::Destroying));
}

/// The last handle of a fabric dropped by an id's teardown on an application thread (the
/// id's context held it) while a callback waits for that thread to go on: the shutdown the
/// drop starts must not wait for that callback. It completes on a thread of its own.
#[test]
fn last_handle_dropped_in_a_teardown_while_a_callback_waits() {
    let port = 25025;
    let f = fabric(port);
    let (b, go_tx) = waiting_callback(&f);
    let a = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    a.set_context(f.clone());
    drop(f);
    let destroyed = within(T, move || a.destroy());
    assert_eq!(
        destroyed,
        Some(Ok(DestroyOutcome::Done)),
        "the destroy hung in the shutdown"
    );
    go_tx.send(()).expect("go");
    assert!(
        eventually(T, || std::net::UdpSocket::bind(addr(1, port)).is_ok()),
        "the shutdown did not complete"
    );
    assert!(eventually(T, || b.state() == State::Destroying));
}

/// Replacing an id's context drops the old one with no lock held: here it is the fabric's
/// last handle, whose drop shuts the fabric down and tears this very id down (which takes
/// the id's state lock: dropped under it, that hung).
#[test]
fn replacing_a_context_that_holds_the_last_fabric_handle() {
    let port = 25026;
    let f = fabric(port);
    let a = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    a.set_context(f.clone());
    drop(f);
    let a = within(T, move || {
        a.set_context(());
        a
    })
    .expect("set_context hung");
    assert_eq!(a.state(), State::Destroying);
    assert!(std::net::UdpSocket::bind(addr(1, port)).is_ok());
}

/// A shutdown that starts while another is under way (here one started from a callback,
/// which runs on a thread of its own) returns only once the first has stopped the devices.
#[test]
fn a_second_shutdown_waits_for_the_first() {
    let port = 25027;
    let f = fabric(port);
    let (tx, started) = mpsc::channel();
    let f2 = f.clone();
    let a = f.create_id(PortSpace::Tcp, move |_, ev| {
        if matches!(ev, Event::AddrResolved) {
            f2.shutdown();
            let _ = tx.send(());
        }
        Flow::Continue
    });
    a.resolve_addr(None, addr(1, 7000)).unwrap();
    started
        .recv_timeout(T)
        .expect("the callback's shutdown started");
    f.shutdown();
    assert!(
        std::net::UdpSocket::bind(addr(1, port)).is_ok(),
        "shutdown returned with the device still open"
    );
}

/// A fabric whose threads poll long before they sleep (`FabricConfig::spin`, here a
/// minute) shuts down without waiting the polls out: a callback thread polling for more
/// work, and each device's own thread (RoCEv2 and iWARP), end their polls when told to stop.
/// (The callback threads' poll looked only for work, so a shutdown waited for its end.)
#[test]
fn a_shutdown_does_not_wait_out_the_threads_polls() {
    let f = Fabric::loopback_with(
        2,
        rcm::FabricConfig {
            spin: Duration::from_secs(60),
            ..config(25029)
        },
    )
    .expect("loopback devices");
    f.add_iwarp_device(ip(3)).expect("iWARP device");
    // An event for a callback, so that a callback thread has worked and then polls.
    let (tx, got) = mpsc::channel();
    let tx = Mutex::new(tx);
    let a = f.create_id(PortSpace::Tcp, move |_, ev| {
        let _ = tx.lock().unwrap().send(matches!(ev, Event::AddrResolved));
        Flow::Continue
    });
    a.resolve_addr(None, addr(1, 7000)).unwrap();
    assert_eq!(got.recv_timeout(T), Ok(true));
    assert!(
        within(Duration::from_secs(30), move || f.shutdown()).is_some(),
        "the shutdown waited for a thread's poll to run out"
    );
}

// ----- No deadlock under concurrent protocol traffic ---------------------------------------

/// Sets its flag when dropped (stops helper threads even when an assertion fails).
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Point 4's "never deadlocks" for plain API calls, and point 1's "arrive" (no event lost):
/// eight threads each run connection cycles (resolve, route, connect, establish, disconnect,
/// destroy — and connects to a port nobody listens on, whose REJ comes straight back)
/// against a listener that accepts in its callback. Every call that sends a message
/// (`connect`, `accept`, `disconnect`) races the peer's immediate answer on loopback. No
/// thread may stop making progress, every call's outcome event must arrive, and the state
/// after it must be the outcome's (a REJECTED id is in `Disconnect`).
#[test]
fn concurrent_connection_cycles_never_deadlock_nor_lose_events() {
    const THREADS: usize = 8;
    let f = fabric(25020);
    // When the server's callback started its current call (0: idle), in ms since `t0`.
    let t0 = Instant::now();
    let server_busy = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let busy = server_busy.clone();
    let server = f.create_id(PortSpace::Tcp, move |id, ev| {
        busy.store(t0.elapsed().as_millis() as u64 + 1, Ordering::SeqCst);
        let flow = match ev {
            Event::ConnectRequest { .. } => {
                let _ = id.accept(&AcceptOptions::default());
                Flow::Continue
            }
            Event::Disconnected | Event::Rejected { .. } | Event::Unreachable(_) => Flow::Destroy,
            _ => Flow::Continue,
        };
        busy.store(0, Ordering::SeqCst);
        flow
    });
    server.bind(addr(1, 7000)).unwrap();
    server.listen(0).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let progress: Arc<Vec<AtomicUsize>> =
        Arc::new((0..THREADS).map(|_| AtomicUsize::new(0)).collect());
    let doing: Arc<Vec<Mutex<&'static str>>> =
        Arc::new((0..THREADS).map(|_| Mutex::new("start")).collect());
    let lost = Arc::new(Mutex::new(Vec::<String>::new()));
    for t in 0..THREADS {
        let (f, stop, progress, doing) = (f.clone(), stop.clone(), progress.clone(), doing.clone());
        let lost = lost.clone();
        thread::spawn(move || {
            let ch = EventChannel::new();
            let step = |what: &'static str| {
                *doing[t].lock().unwrap() = what;
                progress[t].fetch_add(1, Ordering::SeqCst);
            };
            let wait_for = |id: &CmId, name: &str| -> bool {
                let end = Instant::now() + Duration::from_secs(2);
                while Instant::now() < end {
                    if let Some(e) = ch.get_event(Some(Duration::from_millis(50))) {
                        if e.id() == id && e.event().name() == name {
                            return true;
                        }
                    }
                }
                false
            };
            let mut n = 0u32;
            // Each call's outcome must arrive: a missing one is a lost event.
            let expect = |id: &CmId, name: &'static str| -> bool {
                if wait_for(id, name) {
                    true
                } else {
                    lost.lock().unwrap().push(format!(
                        "{name} for id {} (state {:?})",
                        id.key(),
                        id.state()
                    ));
                    false
                }
            };
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                let port = if n % 3 == 0 { 9 } else { 7000 };
                let id = f.create_id_on(PortSpace::Tcp, &ch);
                step("resolve_addr");
                id.resolve_addr(None, addr(1, port)).unwrap();
                if expect(&id, "ADDR_RESOLVED") {
                    step("resolve_route");
                    id.resolve_route().unwrap();
                    if expect(&id, "ROUTE_RESOLVED") {
                        step("connect");
                        id.connect(&ConnectOptions::default()).unwrap();
                        if port == 9 {
                            if expect(&id, "REJECTED") && id.state() != State::Disconnect {
                                lost.lock().unwrap().push(format!(
                                    "id {} is {:?} after its REJECTED",
                                    id.key(),
                                    id.state()
                                ));
                            }
                        } else if expect(&id, "CONNECT_RESPONSE") {
                            step("establish");
                            id.establish().unwrap();
                            if expect(&id, "ESTABLISHED") {
                                step("disconnect");
                                id.disconnect().unwrap();
                                expect(&id, "DISCONNECTED");
                            }
                        }
                    }
                }
                step("destroy");
                let _ = id.destroy();
                step("cycle done");
            }
        });
    }
    // CPU hogs: threads get preempted at arbitrary points (e.g. between sending a request
    // and recording that they did), as on a loaded machine.
    let hogs: Vec<_> = (0..3)
        .map(|_| {
            let stop = stop.clone();
            thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    // Whatever happens below (a failed assertion included), the threads stop.
    let _stop_guard = StopOnDrop(stop.clone());
    let started = Instant::now();
    let mut last = [0usize; THREADS];
    let mut since = [Instant::now(); THREADS];
    while started.elapsed() < Duration::from_secs(4) {
        thread::sleep(Duration::from_millis(100));
        for t in 0..THREADS {
            let p = progress[t].load(Ordering::SeqCst);
            if p != last[t] {
                last[t] = p;
                since[t] = Instant::now();
            }
            assert!(
                since[t].elapsed() < Duration::from_secs(4),
                "thread {t} stuck in {} for {:?} (deadlock); progress {last:?}",
                doing[t].lock().unwrap(),
                since[t].elapsed()
            );
        }
        let b = server_busy.load(Ordering::SeqCst);
        assert!(
            b == 0 || t0.elapsed().as_millis() as u64 + 1 - b < 3000,
            "the server's callback (accept) has been stuck for {} ms (deadlock)",
            t0.elapsed().as_millis() as u64 + 1 - b
        );
    }
    stop.store(true, Ordering::SeqCst);
    for h in hogs {
        h.join().unwrap();
    }
    let lost = lost.lock().unwrap().clone();
    assert!(
        lost.is_empty(),
        "{} events lost (not there within 2 s) or states not matching the event \
         (first 10): {:?}",
        lost.len(),
        &lost[..lost.len().min(10)]
    );
    assert!(
        last.iter().all(|p| *p > 10),
        "too little progress: {last:?}"
    );
    let done = within(Duration::from_secs(5), move || f.shutdown());
    assert!(
        done.is_some(),
        "Fabric::shutdown hung (a callback thread is stuck)"
    );
}

// ----- Callbacks run by the calling thread (CallbacksHere) ----------------------------------

/// Under a `CallbacksHere` guard, the callbacks of the events the thread's own calls produce
/// run on that thread when the guard drops (not before, not on a dispatcher thread), in
/// order, with `Flow::Destroy` and destroy-from-inside working as on a dispatcher thread;
/// without the guard they run on a dispatcher thread.
#[test]
fn callbacks_here_run_on_the_calling_thread_when_the_guard_drops() {
    let f = fabric(25040);
    let seen: Arc<Mutex<Vec<(u32, thread::ThreadId)>>> = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    let id = f.create_id(PortSpace::Tcp, move |id, ev| {
        let n = seq_of(&ev).expect("only AddrError events");
        s.lock().unwrap().push((n, thread::current().id()));
        match n {
            // Destroy from inside: deferred to the return, as on any callback thread.
            3 => {
                assert_eq!(id.destroy(), Ok(DestroyOutcome::Deferred));
                Flow::Continue
            }
            _ => Flow::Continue,
        }
    });
    let me = thread::current().id();
    {
        let _here = rcm::CallbacksHere::begin();
        poke(&id, 1);
        poke(&id, 2);
        {
            // A nested guard leaves the running to the outer one.
            let _inner = rcm::CallbacksHere::begin();
            poke(&id, 3);
        }
        thread::sleep(Duration::from_millis(50));
        assert!(
            seen.lock().unwrap().is_empty(),
            "a callback ran before the guard dropped"
        );
    }
    assert_eq!(
        *seen.lock().unwrap(),
        vec![(1, me), (2, me), (3, me)],
        "in order, on this thread, at the drop"
    );
    // The destroy asked for inside the callback took effect: nothing more is delivered.
    assert_eq!(id.state(), State::Destroying);
    assert!(id.resolve_addr(None, unreachable_dst(4)).is_err());

    // Without a guard: a dispatcher thread runs them.
    let s = seen.clone();
    let (tx, rx) = mpsc::channel();
    let other = f.create_id(PortSpace::Tcp, move |_, ev| {
        let n = seq_of(&ev).expect("only AddrError events");
        s.lock().unwrap().push((n, thread::current().id()));
        let _ = tx.send(());
        Flow::Destroy
    });
    poke(&other, 5);
    rx.recv_timeout(T).expect("the callback ran");
    let last = *seen.lock().unwrap().last().unwrap();
    assert_eq!(last.0, 5);
    assert_ne!(last.1, me, "ran on a dispatcher thread");
    assert!(eventually(T, || f.live_ids() == 0));
    f.shutdown();
}

/// A destroy racing a `connect` whose REQ is rejected at once (same device, nobody listens:
/// the engine's REJ is routed while `connect` still holds its endpoint's handle): the
/// teardown did not see that endpoint, so `connect` must end it, which it does when it finds
/// the id `Destroying`. The REJ routed meanwhile used to overwrite that state with
/// `Disconnect`, and the endpoint outlived its id.
#[test]
fn a_destroy_racing_a_rejected_connect_leaves_no_endpoint() {
    let f = fabric(25107);
    let ch = EventChannel::new();
    let dst = addr(1, 7999);
    let go = Arc::new(Barrier::new(2));
    let (to_connector, connector_rx) = mpsc::channel::<Option<CmId>>();
    let connector = thread::spawn({
        let go = go.clone();
        move || {
            let mut refused = 0usize;
            while let Ok(Some(id)) = connector_rx.recv() {
                go.wait();
                refused += usize::from(id.connect(&ConnectOptions::default()).is_err());
            }
            refused
        }
    });
    for _ in 0..3000 {
        let id = f.create_id_on(PortSpace::Tcp, &ch);
        id.resolve_addr(Some(ip(1)), dst).unwrap();
        expect_ev(&ch, &id, "ADDR_RESOLVED");
        id.resolve_route().unwrap();
        expect_ev(&ch, &id, "ROUTE_RESOLVED");
        to_connector.send(Some(id.clone())).unwrap();
        go.wait();
        // Held events (a REJECTED taken below) must not refuse the destroy.
        let _ = id.destroy();
        while let Some(mut e) = ch.get_event(Some(Duration::ZERO)) {
            drop(e.take());
        }
    }
    to_connector.send(None).unwrap();
    let refused = connector.join().unwrap();
    let end = Instant::now() + T;
    while (f.engine_ceps() > 0 || f.live_ids() > 0) && Instant::now() < end {
        while let Some(mut e) = ch.get_event(Some(Duration::ZERO)) {
            drop(e.take());
        }
        thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        (f.engine_ceps(), f.live_ids()),
        (0, 0),
        "engine endpoints and ids left after 3,000 connects raced by destroys \
         ({refused} connects refused as destroyed)"
    );
    f.shutdown();
}
