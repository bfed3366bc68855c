//! Loom models of the concurrency core (`src/slot.rs`): destroy, deferred and non-blocking
//! destroy, `Flow::Destroy`, device removal and channel mode meeting a callback in flight.
//!
//! Built only with `--cfg loom`:
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test -p rcm --test loom --release --target-dir target/loom
//! ```
//!
//! A failed check inside a callback cannot simply panic (the core catches callback panics and
//! destroys the id), so every check goes through [`Rec::check`], which records the violation;
//! each model asserts at its end that none was recorded.
#![cfg(loom)]

use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use loom::sync::{Condvar, Mutex};
use loom::thread;
use rcm::loom_api::{Channel, Phase, SlotHandle, WeakSlot};
use rcm::{DestroyOutcome, Flow};
use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};
use std::task::{Wake, Waker};
use std::time::Instant;

// ---------------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------------

/// Runs `f` under loom with an optional preemption bound; prints the iteration count and time.
fn model(name: &str, preemption_bound: Option<usize>, f: impl Fn() + Send + Sync + 'static) {
    let iterations = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let it = iterations.clone();
    let mut b = loom::model::Builder::new();
    if preemption_bound.is_some() {
        b.preemption_bound = preemption_bound;
    }
    let bound = b.preemption_bound;
    let start = Instant::now();
    b.check(move || {
        it.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        f();
    });
    eprintln!(
        "loom model {name}: {} iterations in {:.2?} (preemption bound: {})",
        iterations.load(std::sync::atomic::Ordering::Relaxed),
        start.elapsed(),
        bound.map_or_else(|| "none".to_owned(), |b| b.to_string()),
    );
}

/// What happened to one slot.
#[derive(Default)]
struct Rec {
    /// Callbacks of this slot in flight.
    running: AtomicUsize,
    /// Callbacks started (= events delivered).
    started: AtomicUsize,
    /// `DeviceRemoval` events delivered.
    removals: AtomicUsize,
    /// Events discarded undelivered.
    discarded: AtomicUsize,
    /// Teardown closure runs.
    teardowns: AtomicUsize,
    /// Drops of the context the handler captured.
    drops: AtomicUsize,
    /// Normal events delivered, in delivery order.
    log: std::sync::Mutex<Vec<u8>>,
    /// Violated properties.
    violations: std::sync::Mutex<Vec<&'static str>>,
}

impl Rec {
    fn new() -> Arc<Self> {
        Arc::new(Rec::default())
    }

    fn check(&self, ok: bool, what: &'static str) {
        if !ok {
            self.violations
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(what);
        }
    }

    fn running(&self) -> usize {
        self.running.load(SeqCst)
    }

    fn started(&self) -> usize {
        self.started.load(SeqCst)
    }

    fn teardowns(&self) -> usize {
        self.teardowns.load(SeqCst)
    }

    fn drops(&self) -> usize {
        self.drops.load(SeqCst)
    }

    fn log(&self) -> Vec<u8> {
        self.log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The id is gone: torn down and its context dropped exactly once, no callback running.
    fn check_gone(&self, when: &'static str) {
        self.check(self.running() == 0, when);
        self.check(self.teardowns() == 1, when);
        self.check(self.drops() == 1, when);
    }

    /// End of a model: no violation, and every pushed event delivered or discarded once.
    fn finish(&self, pushed: usize) {
        let v = self
            .violations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        assert!(v.is_empty(), "violations: {v:?}");
        assert_eq!(
            self.started() + self.discarded.load(SeqCst),
            pushed,
            "events delivered + discarded != pushed"
        );
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Normal(u8),
    Removal,
}

/// The models' event: its kind, and the record its discard is counted in.
struct Ev {
    kind: Kind,
    rec: Arc<Rec>,
}

fn ev(rec: &Arc<Rec>, kind: Kind) -> Ev {
    Ev {
        kind,
        rec: rec.clone(),
    }
}

fn discard(ev: Ev) {
    let Ev { rec, .. } = ev;
    rec.discarded.fetch_add(1, SeqCst);
}

/// The context the handler captures; its drop is counted.
struct Ctx(Arc<Rec>);

impl Drop for Ctx {
    fn drop(&mut self) {
        let r = &self.0;
        r.check(r.running() == 0, "context dropped while a callback runs");
        r.check(r.teardowns() == 1, "context dropped before the teardown");
        r.drops.fetch_add(1, SeqCst);
    }
}

/// A handler that records its calls around `body` and checks they never overlap or follow the
/// teardown.
fn handler(
    rec: &Arc<Rec>,
    body: impl Fn(&Ev) -> Flow + Send + Sync + 'static,
) -> impl Fn(Ev) -> Flow + Send + Sync + 'static {
    let ctx = Ctx(rec.clone());
    move |ev: Ev| {
        let r = &ctx.0;
        r.check(r.running.fetch_add(1, SeqCst) == 0, "callbacks overlap");
        r.check(r.teardowns() == 0, "callback after the teardown");
        r.started.fetch_add(1, SeqCst);
        match ev.kind {
            Kind::Removal => {
                r.removals.fetch_add(1, SeqCst);
            }
            Kind::Normal(n) => r
                .log
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(n),
        }
        let flow = body(&ev);
        r.running.fetch_sub(1, SeqCst);
        flow
    }
}

/// The teardown closure: counted, and checked to run after the last callback, before the drop.
fn teardown(rec: &Arc<Rec>) -> impl FnOnce() + Send + 'static {
    let r = rec.clone();
    move || {
        r.check(r.running() == 0, "teardown while a callback runs");
        r.check(r.drops() == 0, "teardown after the context drop");
        r.teardowns.fetch_add(1, SeqCst);
    }
}

/// A callback-mode slot with an inline scheduler, the recording handler and teardown.
fn slot(rec: &Arc<Rec>, body: impl Fn(&Ev) -> Flow + Send + Sync + 'static) -> SlotHandle<Ev> {
    // The inline scheduler: drains on the pushing thread.
    let s = SlotHandle::with_callback(handler(rec, body), |s| s.drain(), discard);
    s.set_teardown(teardown(rec));
    s
}

/// A waker that sets a flag under a loom mutex and signals a loom condition variable.
#[derive(Default)]
struct Signal(Mutex<bool>, Condvar);

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        *self.0.lock().unwrap() = true;
        self.1.notify_all();
    }
}

/// Polls `ready` with a loom-visible waker until it returns true, sleeping between polls until
/// woken (a lost wake-up is a loom deadlock).
fn block_on(ready: impl Fn(&Waker) -> bool) {
    let signal = Arc::new(Signal::default());
    let waker = Waker::from(signal.clone());
    while !ready(&waker) {
        let mut woken = signal.0.lock().unwrap();
        while !*woken {
            woken = signal.1.wait(woken).unwrap();
        }
        *woken = false;
    }
}

/// A weak handle filled in after the slot exists (a callback that names its own or another
/// slot).
type Cell = Arc<OnceLock<WeakSlot<Ev>>>;

fn upgrade(c: &Cell) -> Option<SlotHandle<Ev>> {
    c.get().and_then(WeakSlot::upgrade)
}

// ---------------------------------------------------------------------------------------------
// Models
// ---------------------------------------------------------------------------------------------

/// 1. A blocking destroy from a plain thread against a callback in flight on another: `Done`
///    means the callback finished, the teardown ran and the context was dropped, and no
///    callback starts afterwards.
#[test]
fn m1_blocking_destroy_vs_callback_in_flight() {
    model("1 blocking destroy x callback", None, || {
        let rec = Rec::new();
        let s = slot(&rec, |_| Flow::Continue);
        let a = {
            let (s, rec) = (s.clone(), rec.clone());
            thread::spawn(move || s.push(ev(&rec, Kind::Normal(1))))
        };
        assert_eq!(s.destroy(true), Ok(DestroyOutcome::Done));
        rec.check_gone("blocking destroy returned Done before the id was gone");
        let started_at_done = rec.started();
        a.join().unwrap();
        assert_eq!(rec.started(), started_at_done, "callback after Done");
        assert_eq!(s.phase(), Phase::Destroyed);
        rec.check_gone("end");
        rec.finish(1);
    });
}

/// 2. `Flow::Destroy` against a concurrent device removal: the removal is never delivered
///    after the callback returned `Destroy`.
#[test]
fn m2_flow_destroy_vs_removal() {
    model("2 Flow::Destroy x push_removal", None, || {
        let rec = Rec::new();
        let returned_destroy = Arc::new(AtomicBool::new(false));
        let rd = returned_destroy.clone();
        let r2 = rec.clone();
        let s = slot(&rec, move |ev| match ev.kind {
            Kind::Normal(_) => {
                rd.store(true, SeqCst);
                Flow::Destroy
            }
            Kind::Removal => {
                r2.check(!rd.load(SeqCst), "removal delivered after Flow::Destroy");
                Flow::Continue
            }
        });
        let a = {
            let (s, rec) = (s.clone(), rec.clone());
            thread::spawn(move || s.push(ev(&rec, Kind::Normal(1))))
        };
        let b = {
            let (s, rec) = (s.clone(), rec.clone());
            thread::spawn(move || {
                s.push_removal(ev(&rec, Kind::Removal));
            })
        };
        a.join().unwrap();
        b.join().unwrap();
        if returned_destroy.load(SeqCst) {
            // The callback's own destroy completed when it returned.
            assert_eq!(s.phase(), Phase::Destroyed);
            rec.check_gone("after Flow::Destroy");
        }
        assert_eq!(s.destroy(true), Ok(DestroyOutcome::Done));
        assert!(rec.removals.load(SeqCst) <= 1);
        rec.check_gone("end");
        rec.finish(2);
    });
}

/// 3. Destroy from inside the id's own callback (with another event pushed concurrently):
///    `Deferred`, no deadlock, the teardown after the callback returns, no further callback.
#[test]
fn m3_destroy_from_own_callback() {
    model("3 destroy from own callback", None, || {
        let rec = Rec::new();
        let me: Cell = Arc::default();
        let (me2, r2) = (me.clone(), rec.clone());
        let s = slot(&rec, move |_| {
            let Some(s) = upgrade(&me2) else {
                r2.check(false, "slot gone inside its callback");
                return Flow::Continue;
            };
            let r = s.destroy(true);
            r2.check(
                r == Ok(DestroyOutcome::Deferred),
                "own destroy not Deferred",
            );
            r2.check(
                s.phase() == Phase::Destroying,
                "not Destroying after own destroy",
            );
            r2.check(
                r2.teardowns() == 0,
                "teardown inside the destroying callback",
            );
            Flow::Continue
        });
        me.set(s.downgrade()).ok().unwrap();
        let pushers: Vec<_> = [1, 2]
            .into_iter()
            .map(|n| {
                let (s, rec) = (s.clone(), rec.clone());
                thread::spawn(move || s.push(ev(&rec, Kind::Normal(n))))
            })
            .collect();
        s.wait_destroyed();
        rec.check_gone("wait_destroyed returned before the id was gone");
        for p in pushers {
            p.join().unwrap();
        }
        assert_eq!(rec.started(), 1, "a callback after the own destroy");
        rec.check_gone("end");
        rec.finish(2);
    });
}

/// 4. Two ids whose callbacks destroy each other (blocking), on two threads: no deadlock,
///    both torn down exactly once.
#[test]
fn m4_mutual_destroy_from_callbacks() {
    model("4 mutual destroy from callbacks", None, || {
        let recs = [Rec::new(), Rec::new()];
        let cells: [Cell; 2] = [Arc::default(), Arc::default()];
        let slots: Vec<SlotHandle<Ev>> = (0..2)
            .map(|i| {
                let other = cells[1 - i].clone();
                let (me, them) = (recs[i].clone(), recs[1 - i].clone());
                slot(&recs[i], move |_| {
                    if let Some(o) = upgrade(&other) {
                        match o.destroy(true) {
                            Ok(DestroyOutcome::Done) => them.check_gone("other's destroy Done"),
                            Ok(DestroyOutcome::Deferred) => me
                                .check(o.phase() != Phase::Live, "other still live after Deferred"),
                            Err(_) => me.check(false, "destroy failed without channel events"),
                        }
                    }
                    Flow::Continue
                })
            })
            .collect();
        for (c, s) in cells.iter().zip(&slots) {
            c.set(s.downgrade()).ok().unwrap();
        }
        let ts: Vec<_> = (0..2)
            .map(|i| {
                let (s, rec) = (slots[i].clone(), recs[i].clone());
                thread::spawn(move || s.push(ev(&rec, Kind::Normal(1))))
            })
            .collect();
        for t in ts {
            t.join().unwrap();
        }
        for (s, rec) in slots.iter().zip(&recs) {
            assert_eq!(s.destroy(true), Ok(DestroyOutcome::Done));
            rec.check_gone("end");
            rec.finish(1);
        }
    });
}

/// 5. Non-blocking destroy on one thread against a callback in flight on another, and a
///    third awaiting the completion (the `DestroyHandle` path, through a waker): the destroy
///    returns without waiting (the callback waits for it to return), and completion is
///    observed only once the callback returned, the teardown ran and the context was dropped.
#[test]
fn m5_nonblocking_destroy_vs_callback() {
    model("5 non-blocking destroy x callback", None, || {
        let rec = Rec::new();
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let g2 = gate.clone();
        let s = slot(&rec, move |_| {
            // Blocks until destroy(false) returned: if it waited for this callback, loom
            // reports a deadlock.
            let mut open = g2.0.lock().unwrap();
            while !*open {
                open = g2.1.wait(open).unwrap();
            }
            Flow::Continue
        });
        let a = {
            let (s, rec) = (s.clone(), rec.clone());
            thread::spawn(move || s.push(ev(&rec, Kind::Normal(1))))
        };
        let b = {
            let (s, rec) = (s.clone(), rec.clone());
            thread::spawn(move || {
                let r = s.destroy(false);
                *gate.0.lock().unwrap() = true;
                gate.1.notify_all();
                match r {
                    Ok(DestroyOutcome::Done) => rec.check_gone("non-blocking destroy Done"),
                    Ok(DestroyOutcome::Deferred) => {}
                    Err(_) => rec.check(false, "non-blocking destroy failed"),
                }
            })
        };
        block_on(|w| s.poll_destroyed(w));
        assert_eq!(s.phase(), Phase::Destroyed);
        rec.check_gone("completion observed before the id was gone");
        let started_at_done = rec.started();
        a.join().unwrap();
        b.join().unwrap();
        assert_eq!(rec.started(), started_at_done, "callback after completion");
        rec.finish(1);
    });
}

/// 5b. As 5 without the gate, so the callback may return while the non-blocking destroy is
///     still inside `destroy`, and with the completion observed by a third thread: it implies
///     the callback returned, the teardown ran and the context was dropped.
#[test]
fn m5b_nonblocking_destroy_completion_observer() {
    model("5b non-blocking destroy x callback x waiter", None, || {
        let rec = Rec::new();
        let s = slot(&rec, |_| Flow::Continue);
        let a = {
            let (s, rec) = (s.clone(), rec.clone());
            thread::spawn(move || s.push(ev(&rec, Kind::Normal(1))))
        };
        let b = {
            let (s, rec) = (s.clone(), rec.clone());
            thread::spawn(move || match s.destroy(false) {
                Ok(DestroyOutcome::Done) => rec.check_gone("non-blocking destroy Done"),
                Ok(DestroyOutcome::Deferred) => {}
                Err(_) => rec.check(false, "non-blocking destroy failed"),
            })
        };
        s.wait_destroyed();
        rec.check_gone("completion observed before the id was gone");
        let started_at_done = rec.started();
        a.join().unwrap();
        b.join().unwrap();
        assert_eq!(rec.started(), started_at_done, "callback after completion");
        rec.finish(1);
    });
}

/// 6. Device removal against a blocking destroy and a callback in flight: at most one
///    `DeviceRemoval` delivered, none once destroy returned, a removal pushed after it is
///    refused.
#[test]
fn m6_removal_vs_destroy_vs_callback() {
    model("6 removal x blocking destroy x callback", Some(4), || {
        let rec = Rec::new();
        let destroyed = Arc::new(AtomicBool::new(false));
        let (d2, r2) = (destroyed.clone(), rec.clone());
        let s = slot(&rec, move |_| {
            r2.check(!d2.load(SeqCst), "callback after destroy returned");
            Flow::Continue
        });
        let a = {
            let (s, rec) = (s.clone(), rec.clone());
            thread::spawn(move || s.push(ev(&rec, Kind::Normal(1))))
        };
        let b = {
            let (s, rec, destroyed) = (s.clone(), rec.clone(), destroyed.clone());
            thread::spawn(move || {
                for _ in 0..2 {
                    let after = destroyed.load(SeqCst);
                    let queued = s.push_removal(ev(&rec, Kind::Removal));
                    rec.check(!(after && queued), "removal queued after destroy");
                }
            })
        };
        assert_eq!(s.destroy(true), Ok(DestroyOutcome::Done));
        destroyed.store(true, SeqCst);
        rec.check_gone("blocking destroy returned Done before the id was gone");
        let started_at_done = rec.started();
        a.join().unwrap();
        b.join().unwrap();
        assert_eq!(rec.started(), started_at_done, "callback after Done");
        assert!(
            rec.removals.load(SeqCst) <= 1,
            "more than one DeviceRemoval"
        );
        rec.finish(3);
    });
}

/// A channel-mode slot with the recording teardown (no handler, so no context to drop).
fn channel_slot(rec: &Arc<Rec>, ch: &Channel<Ev>) -> SlotHandle<Ev> {
    let s = SlotHandle::with_channel(ch, discard);
    s.set_teardown(teardown(rec));
    s
}

/// 7a. Channel mode: an event taken (held) on one thread against a blocking destroy on
///     another: either the destroy wins (the event is discarded, never handed out) or it fails
///     with the held count, changing nothing; the teardown exactly once, after the ack.
#[test]
fn m7a_channel_held_vs_blocking_destroy() {
    model("7a channel: held x destroy(true)", None, || {
        let rec = Rec::new();
        let ch = Channel::new();
        let (taken, acked) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let s = SlotHandle::with_channel(&ch, discard);
        {
            let (r, taken, acked) = (rec.clone(), taken.clone(), acked.clone());
            let td = teardown(&rec);
            s.set_teardown(move || {
                r.check(
                    !taken.load(SeqCst) || acked.load(SeqCst),
                    "teardown before the ack",
                );
                td();
            });
        }
        s.push(ev(&rec, Kind::Normal(1)));
        let a = {
            let (ch, rec) = (ch.clone(), rec.clone());
            let (taken, acked) = (taken.clone(), acked.clone());
            thread::spawn(move || {
                if let Some((held, e)) = ch.try_take() {
                    taken.store(true, SeqCst);
                    rec.check(rec.teardowns() == 0, "event handed out after the teardown");
                    rec.started.fetch_add(1, SeqCst);
                    drop(e);
                    acked.store(true, SeqCst);
                    held.ack();
                }
            })
        };
        match s.destroy(true) {
            Ok(DestroyOutcome::Done) => {
                rec.check(rec.teardowns() == 1, "Done before the teardown");
            }
            Ok(DestroyOutcome::Deferred) => panic!("blocking destroy from a plain thread deferred"),
            Err(n) => {
                assert_eq!(n, 1, "held count");
                // Nothing changed.
                assert_eq!(s.phase(), Phase::Live);
                assert_eq!(rec.teardowns(), 0);
                assert_eq!(rec.discarded.load(SeqCst), 0);
            }
        }
        a.join().unwrap();
        assert_eq!(s.destroy(true), Ok(DestroyOutcome::Done));
        assert_eq!(rec.teardowns(), 1);
        assert!(ch.is_empty());
        rec.finish(1);
    });
}

/// 7b. Channel mode: an event held, a non-blocking destroy on one thread and the ack on
///     another: the teardown exactly once, after the ack.
#[test]
fn m7b_channel_nonblocking_destroy_then_ack() {
    model("7b channel: held x destroy(false) x ack", None, || {
        let rec = Rec::new();
        let ch = Channel::new();
        let acked = Arc::new(AtomicBool::new(false));
        let s = SlotHandle::with_channel(&ch, discard);
        {
            let (r, acked) = (rec.clone(), acked.clone());
            let td = teardown(&rec);
            s.set_teardown(move || {
                r.check(acked.load(SeqCst), "teardown before the ack");
                td();
            });
        }
        s.push(ev(&rec, Kind::Normal(1)));
        let (held, e) = ch.try_take().expect("event");
        rec.started.fetch_add(1, SeqCst);
        drop(e);
        let a = {
            let (s, rec) = (s.clone(), rec.clone());
            thread::spawn(move || match s.destroy(false) {
                Ok(DestroyOutcome::Done) => rec.check(rec.teardowns() == 1, "Done early"),
                Ok(DestroyOutcome::Deferred) => {}
                Err(_) => rec.check(false, "non-blocking destroy failed"),
            })
        };
        let b = {
            let acked = acked.clone();
            thread::spawn(move || {
                acked.store(true, SeqCst);
                held.ack();
            })
        };
        a.join().unwrap();
        b.join().unwrap();
        s.wait_destroyed();
        assert_eq!(rec.teardowns(), 1);
        rec.finish(1);
    });
}

/// 7c. Channel mode: a blocking destroy after a non-blocking one, with the event still held by
///     the caller, must fail with the held count rather than hang (guarantee 7); after the ack
///     the teardown completes and the blocking destroy is `Done`.
#[test]
fn m7c_channel_blocking_destroy_after_nonblocking_while_held() {
    model(
        "7c channel: held, destroy(false) then destroy(true)",
        None,
        || {
            let rec = Rec::new();
            let ch = Channel::new();
            let s = channel_slot(&rec, &ch);
            s.push(ev(&rec, Kind::Normal(1)));
            let (held, e) = ch.try_take().expect("event");
            rec.started.fetch_add(1, SeqCst);
            drop(e);
            assert_eq!(s.destroy(false), Ok(DestroyOutcome::Deferred));
            assert_eq!(
                s.destroy(true),
                Err(1),
                "blocking destroy with a held event"
            );
            assert_eq!(rec.teardowns(), 0);
            let a = thread::spawn(move || held.ack());
            // Racing the ack: fails while the event is held, else waits for the teardown.
            let r = s.destroy(true);
            assert!(
                matches!(r, Ok(DestroyOutcome::Done) | Err(1)),
                "racing the ack: {r:?}"
            );
            a.join().unwrap();
            assert_eq!(s.destroy(true), Ok(DestroyOutcome::Done));
            assert_eq!(rec.teardowns(), 1);
            rec.finish(1);
        },
    );
}

/// 8a. Two pushers and a dispatcher thread draining what is scheduled: callbacks never
///     overlap, every event is delivered exactly once, each pusher's in order.
#[test]
fn m8a_two_pushers_one_dispatcher() {
    model("8a 2 pushers + dispatcher", Some(3), || {
        // The ready queue and the number of pushers done.
        type Ready = Arc<(Mutex<(VecDeque<SlotHandle<Ev>>, usize)>, Condvar)>;
        let ready: Ready = Arc::new((Mutex::new((VecDeque::new(), 0)), Condvar::new()));
        let rec = Rec::new();
        let sched = {
            let ready = ready.clone();
            move |s: SlotHandle<Ev>| {
                ready.0.lock().unwrap().0.push_back(s);
                ready.1.notify_one();
            }
        };
        let s = SlotHandle::with_callback(handler(&rec, |_| Flow::Continue), sched, discard);
        s.set_teardown(teardown(&rec));
        let pushers: Vec<_> = [&[1u8, 2][..], &[3][..]]
            .into_iter()
            .map(|evs| {
                let (s, rec, ready) = (s.clone(), rec.clone(), ready.clone());
                thread::spawn(move || {
                    for &n in evs {
                        s.push(ev(&rec, Kind::Normal(n)));
                    }
                    ready.0.lock().unwrap().1 += 1;
                    ready.1.notify_one();
                })
            })
            .collect();
        let dispatcher = {
            let ready = ready.clone();
            thread::spawn(move || loop {
                let next = {
                    let mut g = ready.0.lock().unwrap();
                    loop {
                        if let Some(s) = g.0.pop_front() {
                            break Some(s);
                        }
                        if g.1 == 2 {
                            break None;
                        }
                        g = ready.1.wait(g).unwrap();
                    }
                };
                match next {
                    Some(s) => s.drain(),
                    None => return,
                }
            })
        };
        for p in pushers {
            p.join().unwrap();
        }
        dispatcher.join().unwrap();
        check_all_delivered(&rec);
        assert_eq!(s.destroy(true), Ok(DestroyOutcome::Done));
        rec.check_gone("end");
        rec.finish(3);
    });
}

/// 8b. Two pushers with an inline scheduler (each push may drain on its own thread): the
///     scheduled/running flags alone keep the callbacks from overlapping; every event is
///     delivered exactly once, each pusher's in order, by the time the pushers returned.
#[test]
fn m8b_two_pushers_inline() {
    model("8b 2 pushers, inline drains", None, || {
        let rec = Rec::new();
        let s = slot(&rec, |_| Flow::Continue);
        let pushers: Vec<_> = [&[1u8, 2][..], &[3][..]]
            .into_iter()
            .map(|evs| {
                let (s, rec) = (s.clone(), rec.clone());
                thread::spawn(move || {
                    for &n in evs {
                        s.push(ev(&rec, Kind::Normal(n)));
                    }
                })
            })
            .collect();
        for p in pushers {
            p.join().unwrap();
        }
        check_all_delivered(&rec);
        assert_eq!(s.destroy(true), Ok(DestroyOutcome::Done));
        rec.check_gone("end");
        rec.finish(3);
    });
}

/// Events 1, 2 (one pusher, in that order) and 3 (the other) each delivered exactly once.
fn check_all_delivered(rec: &Rec) {
    let log = rec.log();
    let mut sorted = log.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, [1, 2, 3], "not delivered exactly once: {log:?}");
    let pos = |n| log.iter().position(|&x| x == n);
    assert!(pos(1) < pos(2), "one pusher's events out of order: {log:?}");
}

/// 9. Channel mode: a push racing `migrate`: once both returned, no event of the slot is left
///    on the old channel (events move with the id), and the new channel has them in push
///    order (the one queued before the migrate first).
#[test]
fn m9_channel_migrate_vs_push() {
    model("9 channel: migrate x push", None, || {
        let rec = Rec::new();
        let (old, new) = (Channel::new(), Channel::new());
        let s = channel_slot(&rec, &old);
        s.push(ev(&rec, Kind::Normal(1)));
        let a = {
            let (s, rec) = (s.clone(), rec.clone());
            thread::spawn(move || s.push(ev(&rec, Kind::Normal(2))))
        };
        assert!(s.migrate(&new));
        a.join().unwrap();
        assert!(
            old.is_empty(),
            "event left on the old channel after migrate"
        );
        let mut got = Vec::new();
        while let Some((held, e)) = new.try_take() {
            assert!(held.ptr_eq(&s));
            got.push(e.kind);
            rec.started.fetch_add(1, SeqCst);
            held.ack();
        }
        assert_eq!(
            got,
            [Kind::Normal(1), Kind::Normal(2)],
            "moved out of order"
        );
        assert_eq!(s.destroy(true), Ok(DestroyOutcome::Done));
        assert_eq!(rec.teardowns(), 1);
        rec.finish(2);
    });
}

/// 10. An event pushed concurrently with a removal (an engine event routed just before the
///     device went) is delivered before the `DeviceRemoval` or not at all: nothing follows
///     the removal, on a callback slot and on a channel.
#[test]
fn m10_nothing_after_removal() {
    model("10 push x push_removal (callback)", None, || {
        let rec = Rec::new();
        let after = Arc::new(AtomicBool::new(false));
        let (a2, r2) = (after.clone(), rec.clone());
        let s = slot(&rec, move |ev| {
            match ev.kind {
                Kind::Removal => a2.store(true, SeqCst),
                Kind::Normal(_) => r2.check(!a2.load(SeqCst), "an event after DeviceRemoval"),
            }
            Flow::Continue
        });
        let a = {
            let (s, rec) = (s.clone(), rec.clone());
            thread::spawn(move || s.push(ev(&rec, Kind::Normal(1))))
        };
        s.push_removal(ev(&rec, Kind::Removal));
        a.join().unwrap();
        assert_eq!(s.destroy(true), Ok(DestroyOutcome::Done));
        assert_eq!(rec.removals.load(SeqCst), 1);
        rec.finish(2);
    });
    model("10 push x push_removal (channel)", None, || {
        let rec = Rec::new();
        let ch = Channel::new();
        let s = channel_slot(&rec, &ch);
        let a = {
            let (s, rec) = (s.clone(), rec.clone());
            thread::spawn(move || s.push(ev(&rec, Kind::Normal(1))))
        };
        s.push_removal(ev(&rec, Kind::Removal));
        a.join().unwrap();
        let mut kinds = Vec::new();
        while let Some((h, e)) = ch.try_take() {
            kinds.push(e.kind);
            discard(e);
            h.ack();
        }
        let removal_at = kinds.iter().position(|k| *k == Kind::Removal);
        assert_eq!(removal_at, Some(kinds.len() - 1), "order taken: {kinds:?}");
        assert_eq!(s.destroy(true), Ok(DestroyOutcome::Done));
        // Every event was taken (and counted here) or discarded by the slot, once.
        assert_eq!(rec.discarded.load(SeqCst), 2);
    });
}

/// A callback body that checks, on a counter shared by several slots, that no two of their
/// callbacks overlap.
fn no_overlap(rec: &Arc<Rec>, busy: &Arc<AtomicUsize>) -> impl Fn(&Ev) -> Flow + Send + Sync {
    let (r, b) = (rec.clone(), busy.clone());
    move |_: &Ev| {
        r.check(b.fetch_add(1, SeqCst) == 0, "gated callback overlaps");
        b.fetch_sub(1, SeqCst);
        Flow::Continue
    }
}

/// A slot (inline scheduler, recording handler) whose every event is delivered as a
/// callback of `gate` (as a connect request is of its listener).
fn gated(
    rec: &Arc<Rec>,
    body: impl Fn(&Ev) -> Flow + Send + Sync + 'static,
    gate: &SlotHandle<Ev>,
) -> SlotHandle<Ev> {
    let gate = gate.downgrade();
    let c = SlotHandle::with_callback_gated(
        handler(rec, body),
        |s| s.drain(),
        discard,
        move |_| gate.upgrade(),
    );
    c.set_teardown(teardown(rec));
    c
}

/// Pushes `Normal(n)` to `s` from a thread of its own.
fn push_on_a_thread(s: &SlotHandle<Ev>, rec: &Arc<Rec>, n: u8) -> thread::JoinHandle<()> {
    let (s, rec) = (s.clone(), rec.clone());
    thread::spawn(move || s.push(ev(&rec, Kind::Normal(n))))
}

/// 11. An event delivered as a callback of another slot (`Scheduler::gate`: a connect
///     request on its listener) against that slot's own callback: the two never overlap,
///     both run exactly once, and the gated one, parked while the other runs, is scheduled
///     again when it ends instead of waiting on a thread.
#[test]
fn m11_gated_event_vs_the_gate_slots_callback() {
    model("11 gated x callback", None, || {
        // One record per slot (each checks its own teardown and context); the overlap of
        // the two slots' callbacks is checked on a counter they share.
        let (lrec, crec) = (Rec::new(), Rec::new());
        let busy = Arc::new(AtomicUsize::new(0));
        let body = |rec: &Arc<Rec>| no_overlap(rec, &busy);
        let listener = slot(&lrec, body(&lrec));
        let child = gated(&crec, body(&crec), &listener);
        let a = push_on_a_thread(&listener, &lrec, 1);
        child.push(ev(&crec, Kind::Normal(2)));
        a.join().unwrap();
        assert_eq!(
            (lrec.started(), crec.started()),
            (1, 1),
            "both callbacks ran, once each"
        );
        assert_eq!(child.destroy(true), Ok(DestroyOutcome::Done));
        assert_eq!(listener.destroy(true), Ok(DestroyOutcome::Done));
        lrec.finish(1);
        crec.finish(1);
    });
}

/// 12. Two events parked on one gate, whose callback ends while one of them is destroyed:
///     the gate's end schedules one parked slot at a time, and one that will not come (its
///     event discarded by the destroy) passes the turn on, so the other's event is still
///     delivered, exactly once, never overlapping the gate's callbacks, and never left
///     parked on an idle gate.
#[test]
fn m12_hand_off_between_parked_events_vs_destroy() {
    model("12 hand-off x destroy", Some(4), || {
        let (lrec, c1rec, c2rec) = (Rec::new(), Rec::new(), Rec::new());
        let busy = Arc::new(AtomicUsize::new(0));
        let body = |rec: &Arc<Rec>| no_overlap(rec, &busy);
        let listener = slot(&lrec, body(&lrec));
        let (c1, c2) = (
            gated(&c1rec, body(&c1rec), &listener),
            gated(&c2rec, body(&c2rec), &listener),
        );
        let a = push_on_a_thread(&listener, &lrec, 1);
        let b = push_on_a_thread(&c1, &c1rec, 2);
        c2.push(ev(&c2rec, Kind::Normal(3)));
        let _ = c1.destroy(false);
        a.join().unwrap();
        b.join().unwrap();
        assert_eq!(lrec.started(), 1, "the gate's own event ran");
        assert_eq!(c2rec.started(), 1, "the other parked event was delivered");
        assert_eq!(c2.destroy(true), Ok(DestroyOutcome::Done));
        assert_eq!(listener.destroy(true), Ok(DestroyOutcome::Done));
        lrec.finish(1);
        c1rec.finish(1);
        c2rec.finish(1);
    });
}

/// 13. Three events to enter one gate, from three threads, against the gate's own callback:
///     a newcomer may go in while a turn handed on is in flight, and that turn, finding the
///     gate busy, goes back to the front of the list. No event is left parked on an idle
///     gate: each is delivered exactly once, and none overlaps another or the gate's
///     callback.
#[test]
fn m13_a_busy_turn_goes_back_to_the_front() {
    model("13 newcomer x busy turn", None, || {
        let (lrec, c1rec, c2rec, c3rec) = (Rec::new(), Rec::new(), Rec::new(), Rec::new());
        let busy = Arc::new(AtomicUsize::new(0));
        let body = |rec: &Arc<Rec>| no_overlap(rec, &busy);
        let listener = slot(&lrec, body(&lrec));
        let (c1, c2, c3) = (
            gated(&c1rec, body(&c1rec), &listener),
            gated(&c2rec, body(&c2rec), &listener),
            gated(&c3rec, body(&c3rec), &listener),
        );
        let a = push_on_a_thread(&listener, &lrec, 1);
        let b = push_on_a_thread(&c1, &c1rec, 2);
        c2.push(ev(&c2rec, Kind::Normal(3)));
        c3.push(ev(&c3rec, Kind::Normal(4)));
        a.join().unwrap();
        b.join().unwrap();
        assert_eq!(
            (
                lrec.started(),
                c1rec.started(),
                c2rec.started(),
                c3rec.started()
            ),
            (1, 1, 1, 1),
            "every event delivered, once"
        );
        for c in [&c1, &c2, &c3] {
            assert_eq!(c.destroy(true), Ok(DestroyOutcome::Done));
        }
        assert_eq!(listener.destroy(true), Ok(DestroyOutcome::Done));
        for r in [&lrec, &c1rec, &c2rec, &c3rec] {
            r.finish(1);
        }
    });
}
