//! User code that calls back into its own id from where the id cannot finish: a context
//! whose drop destroys the id (or panics), a wait for the id's destruction inside its own
//! callback, calls from inside `with_context`, a context set after the teardown, and
//! callbacks blocked while others wait. A deadlock
//! fails the test (the body runs on a thread given a few seconds) instead of hanging it.
//! UDP ports 29410–29439.
#![cfg(not(loom))]

use rcm::{
    AcceptOptions, CmId, ConnectOptions, DestroyOutcome, Event, EventChannel, Fabric, Flow,
    PortSpace,
};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::thread;
use std::time::Duration;

mod common;
use common::*;

fn client_connect(f: &Fabric, cli: &EventChannel, dst: SocketAddr) -> CmId {
    let client = f.create_id_on(PortSpace::Tcp, cli);
    client.resolve_addr(None, dst).unwrap();
    expect_ev(cli, &client, "ADDR_RESOLVED");
    client.resolve_route().unwrap();
    expect_ev(cli, &client, "ROUTE_RESOLVED");
    client.connect(&ConnectOptions::default()).unwrap();
    client
}

/// An RAII wrapper a user may well keep as an id's context: dropping it destroys the id,
/// and what that destroy returned goes into the shared [`Drops`].
struct DestroyOnDrop(CmId, Arc<Drops>);

impl Drop for DestroyOnDrop {
    fn drop(&mut self) {
        let r = self.0.destroy();
        self.1 .0.lock().unwrap().push(r);
    }
}

/// What the destroys of dropped [`DestroyOnDrop`] contexts returned, one per drop.
#[derive(Default)]
struct Drops(Mutex<Vec<rcm::Result<DestroyOutcome>>>);

impl Drops {
    /// How many contexts were dropped.
    fn count(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    fn results(&self) -> Vec<rcm::Result<DestroyOutcome>> {
        self.0.lock().unwrap().clone()
    }
}

/// The context is dropped inside the id's teardown, before the id is marked destroyed. A
/// context whose `Drop` destroys its own id (an RAII connection wrapper) gets `Deferred`
/// there: waiting would wait for this very drop (it did, and the user's `destroy` hung).
#[test]
fn context_whose_drop_destroys_its_id_does_not_deadlock_destroy() {
    let f = fabric(29410);
    let id = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    let dropped = Arc::new(Drops::default());
    id.set_context(DestroyOnDrop(id.clone(), dropped.clone()));
    let r = within(Duration::from_secs(3), move || id.destroy());
    if r.is_none() {
        // The hung thread holds the id; do not let the fabric's shutdown join anything.
        std::mem::forget(f);
        panic!(
            "CmId::destroy hung: the context's Drop called destroy() on its id from inside the \
             teardown (dropped = {})",
            dropped.count()
        );
    }
    assert_eq!(r, Some(Ok(DestroyOutcome::Done)), "the outer destroy");
    dropped_once_deferred(&dropped, &f);
}

/// The context was dropped once, its destroy inside the teardown deferred; no id is left.
fn dropped_once_deferred(dropped: &Drops, f: &Fabric) {
    assert_eq!(
        dropped.results(),
        [Ok(DestroyOutcome::Deferred)],
        "the context is dropped once, and its destroy inside the teardown is deferred"
    );
    assert_eq!(f.live_ids(), 0);
    f.shutdown();
}

/// Same, through `Flow::Destroy`: the teardown runs on a callback thread after the callback
/// returned, and must finish (that thread was lost for good, the id never destroyed).
#[test]
fn flow_destroy_with_a_context_that_destroys_its_id_completes() {
    let f = fabric(29411);
    let id = f.create_id(PortSpace::Tcp, |_, _| Flow::Destroy);
    let dropped = Arc::new(Drops::default());
    id.set_context(DestroyOnDrop(id.clone(), dropped.clone()));
    poke(&id, 1);
    // The callback returns Flow::Destroy; its teardown drops the context on that thread.
    assert!(eventually(T, || dropped.count() > 0
        || id.state() == rcm::State::Destroying));
    let id2 = id.clone();
    let done = within(Duration::from_secs(3), move || {
        id2.begin_destroy().wait_for(Duration::from_secs(2))
    }) == Some(true);
    if !done {
        std::mem::forget(f);
    }
    assert!(
        done,
        "the id's teardown never completed after Flow::Destroy (context Drop returned: {})",
        dropped.count()
    );
}

/// Same with the non-blocking destroy: `begin_destroy` on an idle id runs the teardown
/// inline, and must return.
#[test]
fn begin_destroy_with_a_context_that_destroys_its_id_returns() {
    let f = fabric(29415);
    let id = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    let dropped = Arc::new(Drops::default());
    id.set_context(DestroyOnDrop(id.clone(), dropped.clone()));
    let done = within(Duration::from_secs(3), move || id.begin_destroy().is_done());
    if done.is_none() {
        std::mem::forget(f);
        panic!("begin_destroy (non-blocking) hung");
    }
    assert_eq!(
        done,
        Some(true),
        "an idle id is torn down inline: done when begin_destroy returns"
    );
    dropped_once_deferred(&dropped, &f);
}

/// Two ids whose contexts destroy each other's id when dropped (the two legs of a proxy):
/// destroying one runs its teardown, whose context drop destroys the other, whose teardown's
/// context drop destroys the first, already being torn down further down this stack. That
/// destroy waited for the first teardown, which waited for it: the caller hung for good.
/// Now a destroy inside a teardown does not wait (`Deferred`), and both ids go.
#[test]
fn contexts_that_destroy_each_others_id_do_not_deadlock() {
    let f = fabric(29440);
    let a = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    let b = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    let dropped = Arc::new(Drops::default());
    a.set_context(DestroyOnDrop(b.clone(), dropped.clone()));
    b.set_context(DestroyOnDrop(a.clone(), dropped.clone()));
    let a2 = a.clone();
    let r = within(Duration::from_secs(3), move || a2.destroy());
    if r.is_none() {
        std::mem::forget(f);
        panic!(
            "destroy hung: two contexts destroying each other's id (dropped = {})",
            dropped.count()
        );
    }
    assert_eq!(r, Some(Ok(DestroyOutcome::Done)));
    assert_eq!(dropped.count(), 2, "both contexts dropped");
    for id in [&a, &b] {
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done), "already gone");
    }
    assert_eq!(f.live_ids(), 0);
}

/// Same through two callbacks returning `Flow::Destroy` at once, on two callback threads:
/// each teardown's context drop destroyed the id the other thread tears down, and each
/// waited for the other (both callback threads lost, no callback ran any more).
#[test]
fn teardowns_on_two_threads_destroying_each_others_id_do_not_deadlock() {
    for round in 0..20u32 {
        let f = fabric(29441);
        let gate = Arc::new(AtomicUsize::new(0));
        let mk = |g: Arc<AtomicUsize>| {
            f.create_id(PortSpace::Tcp, move |_, _| {
                // Both callbacks return together (when they run on two threads), so both
                // teardowns start together.
                g.fetch_add(1, Ordering::SeqCst);
                eventually(Duration::from_secs(1), || g.load(Ordering::SeqCst) >= 2);
                Flow::Destroy
            })
        };
        let (a, b) = (mk(gate.clone()), mk(gate));
        let dropped = Arc::new(Drops::default());
        a.set_context(DestroyOnDrop(b.clone(), dropped.clone()));
        b.set_context(DestroyOnDrop(a.clone(), dropped.clone()));
        poke(&a, 1);
        poke(&b, 1);
        // Both contexts' drops returned (a teardown leaves the fabric's table before it
        // drops the context, so the table alone empties earlier).
        let ok = eventually(Duration::from_secs(3), || {
            dropped.count() == 2 && f.live_ids() == 0
        });
        if !ok {
            std::mem::forget(f);
            panic!(
                "round {round}: the two teardowns hung (dropped = {})",
                dropped.count()
            );
        }
        f.shutdown();
    }
}

/// `with_context` ran the user's closure with the id's state lock held, so any call on the
/// same id from inside the closure took that lock again and deadlocked.
#[test]
fn calling_the_id_from_inside_with_context_does_not_deadlock() {
    let f = fabric(29412);
    let id = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    id.set_context(7u32);
    let id2 = id.clone();
    let r = within(Duration::from_secs(3), move || {
        id2.with_context(|c: &u32| (*c, id2.state()))
    });
    if r.is_none() {
        std::mem::forget(f);
        std::mem::forget(id);
        panic!("id.with_context(|_| id.state()) deadlocked (state lock held across the closure)");
    }
    assert_eq!(
        r,
        Some(Some((7, rcm::State::Idle))),
        "the context, and the state read from inside the closure"
    );
    assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    f.shutdown();
}

/// A context that counts its drops.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// With no lock held across `with_context`'s closure, "the context is dropped before destroy
/// returns" still holds: a destroy on another thread while the closure runs waits for it,
/// and the context is dropped by the time that destroy returns, not before the closure ends.
#[test]
fn a_destroy_elsewhere_waits_for_a_running_with_context() {
    let f = fabric(29419);
    let id = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    let dropped = Arc::new(AtomicUsize::new(0));
    id.set_context(Counted(dropped.clone()));
    let gate = Gate::new();
    let (inside_tx, inside_rx) = mpsc::channel();
    let (id2, g2, d2) = (id.clone(), gate.clone(), dropped.clone());
    let reader = thread::spawn(move || {
        id2.with_context(|_: &Counted| {
            inside_tx.send(()).unwrap();
            g2.wait();
            d2.load(Ordering::SeqCst)
        })
    });
    inside_rx.recv_timeout(T).unwrap();
    let (done_tx, done_rx) = mpsc::channel();
    let (id3, d3) = (id.clone(), dropped.clone());
    let destroyer = thread::spawn(move || {
        let r = id3.destroy();
        done_tx.send(d3.load(Ordering::SeqCst)).unwrap();
        r
    });
    assert!(
        done_rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "destroy returned while with_context's closure still borrowed the context"
    );
    gate.open();
    assert_eq!(
        reader.join().unwrap(),
        Some(0),
        "the context was dropped under the closure"
    );
    assert_eq!(
        done_rx.recv_timeout(T),
        Ok(1),
        "the context is dropped by the time destroy returns"
    );
    assert_eq!(destroyer.join().unwrap(), Ok(DestroyOutcome::Done));
    assert_eq!(id.with_context(|_: &Counted| ()), None);
    f.shutdown();
}

/// From inside `with_context` the id may be destroyed (an idle id is torn down at once:
/// `Done`), its context replaced or borrowed again; what the closure borrows stays alive
/// until it returns and is dropped then, exactly once.
#[test]
fn destroy_and_set_context_from_inside_with_context() {
    let f = fabric(29420);
    let id = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    let (first, second) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    id.set_context(Counted(first.clone()));
    let id2 = id.clone();
    let seen = within(Duration::from_secs(3), {
        let (first, second) = (first.clone(), second.clone());
        move || {
            id2.with_context(|c: &Counted| {
                id2.set_context(Counted(second.clone()));
                let nested = id2.with_context(|n: &Counted| Arc::ptr_eq(&n.0, &second));
                // Replaced, but still borrowed here: not dropped yet.
                let kept = (first.load(Ordering::SeqCst), c.0.load(Ordering::SeqCst));
                (nested, kept)
            })
        }
    });
    assert_eq!(seen, Some(Some((Some(true), (0, 0)))));
    assert_eq!(
        first.load(Ordering::SeqCst),
        1,
        "dropped once the closure returned"
    );
    let id3 = id.clone();
    let inside = within(Duration::from_secs(3), {
        let second = second.clone();
        move || {
            id3.with_context(|_: &Counted| {
                let r = id3.destroy();
                (r, second.load(Ordering::SeqCst), id3.state())
            })
        }
    });
    assert_eq!(
        inside,
        Some(Some((Ok(DestroyOutcome::Done), 0, rcm::State::Destroying))),
        "destroy from inside with_context"
    );
    assert_eq!(
        second.load(Ordering::SeqCst),
        1,
        "dropped when the closure returned"
    );
    assert_eq!(first.load(Ordering::SeqCst), 1);
    f.shutdown();
}

/// `DestroyHandle::wait` from inside the id's own callback returns at once, as `destroy()`
/// there returns `Deferred` (it waited for a teardown that can only follow the callback).
#[test]
fn begin_destroy_wait_from_own_callback_does_not_hang() {
    let f = fabric(29413);
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let id = f.create_id(PortSpace::Tcp, move |id, _| {
        id.begin_destroy().wait();
        let _ = tx.lock().unwrap().send(());
        Flow::Continue
    });
    poke(&id, 1);
    let ok = rx.recv_timeout(Duration::from_secs(3)).is_ok();
    if !ok {
        std::mem::forget(f);
    }
    assert!(
        ok,
        "begin_destroy().wait() from the id's own callback never returned"
    );
}

/// A connect request's callback runs as a callback of its listener, so it waits for the
/// listener's callback in flight (another child's connect-request callback). It waited on a
/// dispatcher thread (`Slot::enter`), so one blocked connect-request callback (allowed in
/// `CallbackMode::Threads`: "A callback may block") plus one more request per remaining
/// dispatcher thread took every callback thread: no other id of the fabric got any
/// callback (with a callback waiting for another id's event, a permanent deadlock). The
/// waiting child is now parked on its listener, holding no thread.
#[test]
fn a_blocked_connect_request_callback_does_not_starve_unrelated_ids() {
    let mut cfg = config(29414);
    cfg.dispatcher_threads = 2;
    let f = Fabric::loopback_with(2, cfg).unwrap();
    let gate = Gate::new();
    let seen = Arc::new(AtomicUsize::new(0));
    let (g, s) = (gate.clone(), seen.clone());
    let listener = f.create_id(PortSpace::Tcp, move |id, ev| {
        if let Event::ConnectRequest { .. } = ev {
            if s.fetch_add(1, Ordering::SeqCst) == 0 {
                g.wait(); // the first request's handler blocks a while
            }
            let _ = id.accept(&AcceptOptions::default());
        }
        Flow::Continue
    });
    listener.bind(addr(1, 7000)).unwrap();
    listener.listen(0).unwrap();
    let cli = EventChannel::new();
    let c1 = client_connect(&f, &cli, addr(1, 7000));
    assert!(eventually(T, || seen.load(Ordering::SeqCst) == 1));
    let c2 = client_connect(&f, &cli, addr(1, 7000));
    // Let the second request's callback reach the other dispatcher thread.
    thread::sleep(Duration::from_millis(500));
    // An unrelated id.
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let other = f.create_id(PortSpace::Tcp, move |_, _| {
        let _ = tx.lock().unwrap().send(());
        Flow::Continue
    });
    poke(&other, 1);
    let delivered = rx.recv_timeout(Duration::from_secs(3)).is_ok();
    gate.open();
    if !delivered {
        // Once the gate opens everything drains: the event is only late, not lost.
        let late = rx.recv_timeout(T).is_ok();
        eprintln!("unrelated id's event delivered after the gate opened: {late}");
    }
    assert!(
        delivered,
        "an unrelated id's event was not delivered in 3 s while one connect-request callback \
         was blocked: both dispatcher threads are taken (one by the blocked handler, one \
         waiting in Slot::enter on the listener)"
    );
    // The parked request is delivered once the blocked one returns.
    assert!(
        eventually(T, || seen.load(Ordering::SeqCst) == 2),
        "the second connect request was never delivered"
    );
    let _ = (
        c1.destroy(),
        c2.destroy(),
        other.destroy(),
        listener.destroy(),
    );
    f.shutdown();
}

/// With one blocked connect-request callback and no second request, the other dispatcher
/// thread still serves unrelated ids.
#[test]
fn control_one_blocked_connect_request_leaves_the_other_thread_free() {
    let mut cfg = config(29416);
    cfg.dispatcher_threads = 2;
    let f = Fabric::loopback_with(2, cfg).unwrap();
    let gate = Gate::new();
    let seen = Arc::new(AtomicUsize::new(0));
    let (g, s) = (gate.clone(), seen.clone());
    let listener = f.create_id(PortSpace::Tcp, move |id, ev| {
        if let Event::ConnectRequest { .. } = ev {
            if s.fetch_add(1, Ordering::SeqCst) == 0 {
                g.wait();
            }
            let _ = id.accept(&AcceptOptions::default());
        }
        Flow::Continue
    });
    listener.bind(addr(1, 7000)).unwrap();
    listener.listen(0).unwrap();
    let cli = EventChannel::new();
    let c1 = client_connect(&f, &cli, addr(1, 7000));
    assert!(eventually(T, || seen.load(Ordering::SeqCst) == 1));
    thread::sleep(Duration::from_millis(500));
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let other = f.create_id(PortSpace::Tcp, move |_, _| {
        let _ = tx.lock().unwrap().send(());
        Flow::Continue
    });
    poke(&other, 1);
    let delivered = rx.recv_timeout(Duration::from_secs(3)).is_ok();
    gate.open();
    assert!(delivered);
    let _ = (c1.destroy(), other.destroy(), listener.destroy());
    f.shutdown();
}

/// A context that refers to its id (a common shape: the connection object holds its
/// `CmId`) is released by the teardown, which breaks the cycle. `set_context` on an id whose
/// teardown already ran (after `destroy` returned `Done`, or racing a destroy on another
/// thread) is dropped at once: kept, nothing would ever drop it (the id and the context
/// would keep each other alive).
#[test]
fn a_context_set_after_destroy_is_not_leaked() {
    struct Conn(#[allow(dead_code)] CmId, #[allow(dead_code)] Tracked);
    let f = fabric(29417);
    let id = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    let drops = Arc::new(AtomicUsize::new(0));
    id.set_context(Conn(id.clone(), Tracked(drops.clone())));
    drop(id);
    f.shutdown();
    drop(f);
    assert!(
        eventually(Duration::from_secs(1), || drops.load(Ordering::SeqCst) == 1),
        "the context set on a destroyed id was never dropped (drops = {})",
        drops.load(Ordering::SeqCst)
    );
}

/// A context whose `Drop` panics (user code, run inside the teardown).
struct PanicOnDrop;

impl Drop for PanicOnDrop {
    fn drop(&mut self) {
        panic!("the context's drop panics (on purpose)");
    }
}

/// A panic in what the teardown drops (the context; a handler's captures) must not leave
/// the id half torn down: `destroy` returns `Done` to its caller, a waiter sees the id
/// destroyed, and through `Flow::Destroy` the dispatcher thread that ran the teardown lives
/// on (with one thread, another id's event is still delivered).
#[test]
fn a_panicking_context_drop_still_completes_the_destroy() {
    let mut cfg = config(29421);
    cfg.dispatcher_threads = 1;
    let f = Fabric::loopback_with(2, cfg).unwrap();
    let id = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    id.set_context(PanicOnDrop);
    let r = within(Duration::from_secs(3), move || id.destroy());
    assert_eq!(r, Some(Ok(DestroyOutcome::Done)), "destroy from the user");

    let flow = f.create_id(PortSpace::Tcp, |_, _| Flow::Destroy);
    flow.set_context(PanicOnDrop);
    poke(&flow, 1);
    let h = flow.begin_destroy();
    assert!(
        within(Duration::from_secs(3), move || h
            .wait_for(Duration::from_secs(2)))
            == Some(true),
        "a waiter never saw the id destroyed"
    );
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let other = f.create_id(PortSpace::Tcp, move |_, _| {
        let _ = tx.lock().unwrap().send(());
        Flow::Continue
    });
    poke(&other, 2);
    assert!(
        rx.recv_timeout(Duration::from_secs(3)).is_ok(),
        "the dispatcher thread died with the panic"
    );
    assert_eq!(other.destroy(), Ok(DestroyOutcome::Done));
    f.shutdown();
}

/// A listener's context that owns the connections its listener handed out and destroys
/// them when it is dropped (a server object kept as the listener's context).
struct Server {
    children: Arc<Mutex<Vec<CmId>>>,
    results: Arc<Mutex<Vec<rcm::Result<DestroyOutcome>>>>,
    entered: Arc<AtomicUsize>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.entered.fetch_add(1, Ordering::SeqCst);
        let kids: Vec<CmId> = std::mem::take(&mut *self.children.lock().unwrap());
        for k in kids {
            let r = k.destroy();
            self.results.lock().unwrap().push(r);
        }
    }
}

/// Property: a listener destroyed (non-blocking, `Deferred`) while a child's connect-request
/// callback runs as its callback is torn down when that callback returns, and what the
/// teardown drops (the listener's context) may destroy that child without hanging: the
/// destroy returns (`Deferred`, the child's drain is still running on this thread) and the
/// listener's destruction completes.
///
/// Interleaving: child C's `ConnectRequest` enters listener L (`try_enter`, L.running = T);
/// the callback blocks on a gate; the main thread calls `L.begin_destroy()` (L Destroying,
/// busy: Deferred); the gate opens, the callback returns; C's `drain` drops the
/// `EnterGuard` on T *after* `call` restored `CURRENT` (no longer "in a callback"), so
/// L's teardown runs on T outside any callback; L's context drop calls `C.destroy()`,
/// which sees C running (on T itself), is not inside a callback, not C's own code, and
/// waited for C to be destroyed — forever (the guard now drops inside the callback, and a
/// destroy of an id whose callback runs on this thread does not wait).
#[test]
fn listener_teardown_after_a_connect_request_may_destroy_that_child() {
    let mut cfg = config(29422);
    cfg.dispatcher_threads = 2;
    let f = Fabric::loopback_with(2, cfg).unwrap();
    let children = Arc::new(Mutex::new(Vec::new()));
    let results = Arc::new(Mutex::new(Vec::new()));
    let entered = Arc::new(AtomicUsize::new(0));
    let gate = Gate::new();
    let (inside_tx, inside_rx) = mpsc::channel();
    let inside_tx = Mutex::new(inside_tx);
    let (kids, g) = (children.clone(), gate.clone());
    let listener = f.create_id(PortSpace::Tcp, move |id, ev| {
        if let Event::ConnectRequest { .. } = ev {
            kids.lock().unwrap().push(id.clone());
            let _ = inside_tx.lock().unwrap().send(());
            g.wait();
        }
        Flow::Continue
    });
    listener.set_context(Server {
        children: children.clone(),
        results: results.clone(),
        entered: entered.clone(),
    });
    listener.bind(addr(1, 7100)).unwrap();
    listener.listen(0).unwrap();
    let cli = EventChannel::new();
    let _client = client_connect(&f, &cli, addr(1, 7100));
    inside_rx
        .recv_timeout(T)
        .expect("the connect request's callback ran");
    // The child's callback runs as the listener's: the destroy cannot finish now.
    let h = listener.begin_destroy();
    assert!(
        !h.is_done(),
        "the listener's callback (the request) is running"
    );
    gate.open();
    let done = h.wait_for(Duration::from_secs(5));
    let (entered, results) = (
        entered.load(Ordering::SeqCst),
        results.lock().unwrap().clone(),
    );
    if !done {
        // A dispatcher thread is stuck in the teardown: do not join it.
        std::mem::forget(f);
    }
    assert!(
        done,
        "the listener was never destroyed: its teardown, run on the child's dispatcher \
         thread when the connect-request callback ended, hangs in the context's drop \
         (drops entered: {entered}, child destroys returned: {results:?})"
    );
    assert_eq!(results.len(), 1, "the child's destroy returned");
}

/// Property: a connect request's callback runs as a callback of its listener, so waiting
/// there for the listener's destruction returns at once, as it does inside the listener's
/// own callback (`DestroyHandle::wait`: "Inside the id's own callback … it returns at
/// once"), instead of waiting for a teardown that can only follow this callback.
///
/// Interleaving: child C's `ConnectRequest` enters listener L (L.running = this thread,
/// CURRENT = C); the callback calls `L.begin_destroy()` (Deferred: L is running) and then
/// `wait()` on it; `wait_destroyed` checked only `runs_own_code(L)` (CURRENT == L, TEARING,
/// borrows), none of which names L, so it waits for L's teardown, which runs only when
/// this thread drops the `EnterGuard` after the callback returns: it was a self-deadlock.
#[test]
fn waiting_for_the_listener_from_a_connect_request_callback_returns() {
    let mut cfg = config(29423);
    cfg.dispatcher_threads = 2;
    let f = Fabric::loopback_with(2, cfg).unwrap();
    let me: Arc<OnceLock<CmId>> = Arc::new(OnceLock::new());
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let m = me.clone();
    let listener = f.create_id(PortSpace::Tcp, move |_, ev| {
        if let Event::ConnectRequest { .. } = ev {
            if let Some(l) = m.get() {
                let h = l.begin_destroy();
                h.wait();
                let _ = tx.lock().unwrap().send(h.is_done());
            }
        }
        Flow::Continue
    });
    let _ = me.set(listener.clone());
    listener.bind(addr(1, 7101)).unwrap();
    listener.listen(0).unwrap();
    let cli = EventChannel::new();
    let _client = client_connect(&f, &cli, addr(1, 7101));
    let r = rx.recv_timeout(Duration::from_secs(5));
    if r.is_err() {
        std::mem::forget(f);
    }
    assert!(
        r.is_ok(),
        "DestroyHandle::wait on the listener from inside a connect request's callback \
         (a callback of that listener) never returned"
    );
}

/// Two threads, each inside `with_context` of one id, destroy each other's id. A teardown
/// that waited for the other thread's borrow to end would wait for a thread that waits for
/// it: each destroy made inside a borrow goes without that wait, and each context is dropped
/// once, when the closure borrowing it returns.
#[test]
fn destroys_crossed_between_two_context_borrows_do_not_deadlock() {
    let f = fabric(29424);
    let x = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    let y = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    let (dx, dy) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    x.set_context(Counted(dx.clone()));
    y.set_context(Counted(dy.clone()));
    let both_inside = Arc::new(std::sync::Barrier::new(2));
    let cross = |mine: CmId, theirs: CmId, both: Arc<std::sync::Barrier>| {
        within(Duration::from_secs(3), move || {
            mine.with_context(|_: &Counted| {
                both.wait();
                theirs.destroy()
            })
        })
    };
    let a = thread::spawn({
        let (x, y, b) = (x.clone(), y.clone(), both_inside.clone());
        move || cross(x, y, b)
    });
    let b = thread::spawn({
        let (x, y, b) = (x.clone(), y.clone(), both_inside.clone());
        move || cross(y, x, b)
    });
    let (a, b) = (a.join().unwrap(), b.join().unwrap());
    assert_eq!(
        (a, b),
        (
            Some(Some(Ok(DestroyOutcome::Done))),
            Some(Some(Ok(DestroyOutcome::Done)))
        ),
        "each destroy returns (None: it hung)"
    );
    assert_eq!(
        (dx.load(Ordering::SeqCst), dy.load(Ordering::SeqCst)),
        (1, 1)
    );
    f.shutdown();
}

/// A callback destroys id X while another thread, inside X's `with_context`, waits in a
/// blocking destroy for that very callback's id. A destroy inside a callback must not wait:
/// X's teardown runs there without waiting for the borrow, the callback returns, the other
/// thread's destroy completes, and X's context is dropped when its closure returns.
#[test]
fn a_callback_destroying_an_id_borrowed_by_a_thread_waiting_for_it_does_not_deadlock() {
    let f = fabric(29425);
    let x = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    let dx = Arc::new(AtomicUsize::new(0));
    x.set_context(Counted(dx.clone()));
    let (in_cb_tx, in_cb_rx) = mpsc::channel();
    let borrowing = Gate::new();
    let outcome = Arc::new(Mutex::new(None));
    let y = f.create_id(PortSpace::Tcp, {
        let (x, borrowing, outcome) = (x.clone(), borrowing.clone(), outcome.clone());
        let in_cb_tx = Mutex::new(in_cb_tx);
        move |_, ev| {
            if matches!(ev, Event::AddrResolved) {
                let _ = in_cb_tx.lock().unwrap().send(());
                borrowing.wait();
                // Let the other thread get into its blocking destroy of this id.
                thread::sleep(Duration::from_millis(50));
                *outcome.lock().unwrap() = Some(x.destroy());
            }
            Flow::Continue
        }
    });
    y.resolve_addr(None, addr(1, 7000)).unwrap();
    in_cb_rx.recv_timeout(T).unwrap();
    let r = within(Duration::from_secs(3), {
        let (x, y, borrowing, dx) = (x.clone(), y.clone(), borrowing.clone(), dx.clone());
        move || {
            x.with_context(|_: &Counted| {
                borrowing.open();
                let r = y.destroy();
                (r, dx.load(Ordering::SeqCst))
            })
        }
    });
    assert_eq!(
        r,
        Some(Some((Ok(DestroyOutcome::Done), 0))),
        "the destroy inside the borrow returns (None: it hung), X's context still alive"
    );
    assert_eq!(
        *outcome.lock().unwrap(),
        Some(Ok(DestroyOutcome::Done)),
        "the callback's destroy of the idle X tears it down at once"
    );
    assert_eq!(
        dx.load(Ordering::SeqCst),
        1,
        "dropped when the closure returned"
    );
    f.shutdown();
}

/// `begin_destroy` never blocks: not even on a `with_context` closure running on another
/// thread. Its handle's waits then wait for that closure, and the context is dropped once,
/// when the closure returns.
#[test]
fn begin_destroy_does_not_wait_for_a_closure_borrowing_the_context() {
    let f = fabric(29426);
    let id = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    let dropped = Arc::new(AtomicUsize::new(0));
    id.set_context(Counted(dropped.clone()));
    let gate = Gate::new();
    let (inside_tx, inside_rx) = mpsc::channel();
    let reader = thread::spawn({
        let (id, gate, dropped) = (id.clone(), gate.clone(), dropped.clone());
        move || {
            id.with_context(|_: &Counted| {
                inside_tx.send(()).unwrap();
                gate.wait();
                dropped.load(Ordering::SeqCst)
            })
        }
    });
    inside_rx.recv_timeout(T).unwrap();
    let handle = within(Duration::from_secs(2), {
        let id = id.clone();
        move || id.begin_destroy()
    })
    .expect("begin_destroy returned while a closure borrowed the context");
    assert!(handle.is_done(), "an idle id is torn down at once");
    assert!(
        !handle.wait_for(Duration::from_millis(100)),
        "wait_for waits for the borrowing closure"
    );
    assert_eq!(
        dropped.load(Ordering::SeqCst),
        0,
        "not dropped under the closure"
    );
    gate.open();
    handle.wait();
    assert_eq!(
        dropped.load(Ordering::SeqCst),
        1,
        "dropped once the closure returned"
    );
    assert_eq!(reader.join().unwrap(), Some(0));
    f.shutdown();
}
