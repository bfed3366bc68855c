//! The concurrency core: one `Slot` per id serialises its callbacks, and destroy, deferred
//! destroy, non-blocking destroy and device removal meet here. It knows nothing of the CM:
//! events are an opaque `E`, the id an opaque [`SlotOwner`] whose teardown it runs.
//!
//! Invariants (each checked by the loom models in `tests/loom.rs` and the stress test):
//! 1. At most one callback per slot runs at a time; events run in the order pushed.
//! 2. After the phase leaves `Live`, no callback starts and pushes are discarded.
//! 3. The owner's teardown and the target (handler or channel, with what it captured) are
//!    dropped exactly once, after the last callback returned and the last held event was acked.
//! 4. A blocking destroy returns only once 3 has happened, except when it would have to wait
//!    for a callback from inside a callback (its own or another id's), or for anything from
//!    inside a teardown (what a teardown drops may destroy ids): then it returns `Deferred`
//!    at once and the teardown happens when the running callback (or teardown) is done.

use crate::sync::{self, Arc, Condvar, Mutex};
use std::collections::VecDeque;
use std::task::Waker;

/// What a callback asks for when it returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Keep the id.
    Continue,
    /// Destroy the id now: no further callback of any kind (device removal included) is made.
    Destroy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Live,
    Destroying,
    Destroyed,
}

/// What `destroy` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DestroyOutcome {
    /// The id is gone: no callback is running and none will ever run; its context was dropped.
    Done,
    /// No callback will *start* any more, but one is running (the caller's own, or the caller
    /// is itself inside a callback and may not wait for another), or the caller runs in a
    /// teardown (the drop of a context or handler) and may not wait; the teardown completes
    /// when that callback returns, or where it already runs.
    Deferred,
}

/// What a slot serialises (the upper layer's id). The slot holds it strongly until the
/// teardown, which it runs exactly once, after the last callback: an id whose handles were
/// all dropped lives until it is destroyed.
pub(crate) trait SlotOwner: Send + Sync {
    /// Releases what the owner holds.
    fn teardown(self: std::sync::Arc<Self>);
    /// Itself, for callbacks and channel consumers to downcast.
    fn as_any(self: std::sync::Arc<Self>) -> std::sync::Arc<dyn std::any::Any + Send + Sync>;
}

/// The slot's owner (until its teardown) and the event. Children share their listener's callback,
/// so the callback learns which id it runs for from the slot.
pub(crate) type Callback<E> =
    Arc<dyn Fn(Option<std::sync::Arc<dyn std::any::Any + Send + Sync>>, E) -> Flow + Send + Sync>;

/// Where a slot's events go.
pub(crate) enum Target<E> {
    Callback(Callback<E>),
    Channel(Arc<ChannelCore<E>>),
}

impl<E> Clone for Target<E> {
    fn clone(&self) -> Self {
        match self {
            Target::Callback(c) => Target::Callback(c.clone()),
            Target::Channel(c) => Target::Channel(c.clone()),
        }
    }
}

/// The default [`crate::FabricConfig::spin`], also how long an [`crate::EventChannel`]'s
/// `get_event` polls before it sleeps.
pub const DEFAULT_SPIN: std::time::Duration = std::time::Duration::from_micros(100);
const DEFAULT_CHANNEL_SPIN_NS: u64 = DEFAULT_SPIN.as_micros() as u64 * 1000;

/// Runs a scheduled slot's pending events (a dispatcher pool, or inline in tests).
pub(crate) trait Scheduler<E>: Send + Sync {
    fn schedule(&self, slot: Arc<Slot<E>>);
    /// Called for every event that is discarded undelivered. Dropping it is the default:
    /// an event's own `Drop` releases what it holds (a connect request's child is rejected).
    fn discard(&self, ev: E) {
        drop(ev);
    }
    /// The slot `ev` must be delivered serialised with (a connect request's listener): its
    /// callback then runs as one of that slot's ([`Slot::try_enter`]). While that slot's
    /// callback runs, the event's slot is parked on it, holding no thread, and scheduled
    /// again in its turn (one per callback end, in the order they parked). Once that slot
    /// is not live the event is dropped undelivered and its slot destroyed. None by default.
    fn gate(&self, _ev: &E) -> Option<Arc<Slot<E>>> {
        None
    }
}

/// What a slot keeps only while it needs it (boxed: most slots never do).
struct Extra<E> {
    /// Async destroys waiting.
    wakers: Vec<Waker>,
    /// Slots whose next event waits for this slot's callback in flight to end, in the order
    /// they came. Each end of a callback schedules one of them (`hand_off`), not all: they
    /// can only go in one at a time, and waking every one at each end made a burst of `n`
    /// connect requests on one listener cost `n²` schedules (the dispatcher's threads
    /// taking turns to find the listener busy again).
    parked: VecDeque<Arc<Slot<E>>>,
}

// Not derived: that would ask `E: Default`.
impl<E> Default for Extra<E> {
    fn default() -> Self {
        Extra {
            wakers: Vec::new(),
            parked: VecDeque::new(),
        }
    }
}

struct Inner<E> {
    phase: Phase,
    queue: VecDeque<E>,
    scheduled: bool,
    running: Option<sync::thread::ThreadId>,
    /// Channel events handed to the user and not yet acked.
    held: u32,
    teardown_started: bool,
    removal_queued: bool,
    /// Destroy was asked from inside this slot's own running callback.
    deferred: bool,
    /// Async destroys waiting, and slots parked on this one's callback.
    extra: Option<Box<Extra<E>>>,
    /// Threads waiting on the slot's condition variable: a state change with none waiting
    /// makes no wake-up system call (one per callback otherwise).
    waiters: u32,
    /// Where this slot stands with the slot its event is to enter (see `GateWait`).
    gate_wait: GateWait,
}

/// Where a slot whose event is to enter another slot (`Scheduler::gate`) stands with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GateWait {
    /// Not waiting for it.
    No,
    /// In its `parked` list (or taken from it by a hand-off that has not looked at it
    /// yet): parking again adds no second entry.
    Parked,
    /// Scheduled by a hand-off: it is this slot's turn. If it finds the gate busy (an event
    /// of the gate's own, or a newcomer, went in first) it goes back to the front of the
    /// list, so the next hand-off is its again. (At the back, behind every slot that parked
    /// meanwhile, a request could wait for all of them again and again under a steady
    /// stream.) A newcomer that finds the gate idle still goes in at once, even with
    /// slots parked: making it wait for the hand-offs cost the daemon (whose callbacks run
    /// inline, its hand-offs on callback threads that sleep) nearly all of its connections
    /// under `rcm stress`.
    Turn,
}

/// One id's serialisation domain.
pub(crate) struct Slot<E> {
    inner: Mutex<Inner<E>>,
    cond: Condvar,
    target: Mutex<Option<Target<E>>>,
    /// Runs the slot's callbacks, and takes its discarded events (one pointer for both: the
    /// fabric's, shared by every id).
    sched: Arc<dyn Scheduler<E>>,
    /// What this slot serialises, until the teardown takes it (one field for both: every id
    /// has one, and a separate teardown closure cost each id a field and an allocation).
    owner: Mutex<Option<std::sync::Arc<dyn SlotOwner>>>,
}

#[cfg(not(loom))]
std::thread_local! {
    static CURRENT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}
#[cfg(loom)]
loom::thread_local! {
    static CURRENT: std::cell::Cell<usize> = std::cell::Cell::new(0);
}

/// A blocking destroy is about to wait: what this thread holds back goes first (its
/// `SendBatch`'s datagrams, its `Pipeline`'s owed answers, see `fabric::before_wait`).
#[cfg(not(loom))]
fn before_blocking() {
    crate::fabric::before_wait();
}
#[cfg(loom)]
fn before_blocking() {}

/// Whether the calling thread is inside some slot's callback.
pub(crate) fn in_callback() -> bool {
    CURRENT.with(|c| c.get() != 0)
}

#[cfg(not(loom))]
std::thread_local! {
    static TEARDOWNS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

// The slot whose teardown the calling thread runs (0: none). What a teardown drops (a
// context, a handler) may destroy or wait for that very id, which cannot finish before it
// returns: such a call must not wait.
#[cfg(not(loom))]
std::thread_local! {
    static TEARING: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}
#[cfg(loom)]
loom::thread_local! {
    static TEARING: std::cell::Cell<usize> = std::cell::Cell::new(0);
}

// The context borrows the calling thread is inside (`CmId::with_context` runs its closure),
// innermost last: the slot's address and the context's. A blocking destroy elsewhere may
// wait for those borrows to end, so a destroy from inside one must wait neither for the
// teardown nor for other threads' borrows.
#[cfg(not(loom))]
std::thread_local! {
    static BORROWS: std::cell::RefCell<Vec<(usize, usize)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Marks the calling thread as borrowing context `ctx` (an address) of a slot while it
/// lives.
#[cfg(not(loom))]
pub(crate) struct Borrow((usize, usize));

#[cfg(not(loom))]
impl Borrow {
    pub(crate) fn enter<E>(s: &Slot<E>, ctx: usize) -> Self {
        let me = (std::ptr::from_ref(s) as usize, ctx);
        BORROWS.with(|b| b.borrow_mut().push(me));
        Borrow(me)
    }
}

#[cfg(not(loom))]
impl Drop for Borrow {
    fn drop(&mut self) {
        let _ = BORROWS.try_with(|b| {
            let mut b = b.borrow_mut();
            if let Some(i) = b.iter().rposition(|&x| x == self.0) {
                b.remove(i);
            }
        });
    }
}

/// How many borrows the calling thread is inside that match `hit` (slot, context).
#[cfg(not(loom))]
pub(crate) fn borrows(hit: impl Fn(usize, usize) -> bool) -> usize {
    BORROWS
        .try_with(|b| b.borrow().iter().filter(|&&(s, c)| hit(s, c)).count())
        .unwrap_or(0)
}

/// Whether the calling thread runs a teardown (any slot's: what it drops, a context or a
/// handler, may destroy other ids). Waiting there for another id's destruction could wait
/// for a teardown further down this stack, or on another thread that waits for this one
/// (two contexts that destroy each other's id when dropped).
fn tearing_down() -> bool {
    TEARING.with(|t| t.get() != 0)
}

/// Whether the calling thread is inside `s`'s own callback, teardown or context borrow,
/// where waiting for `s` to be destroyed would wait for itself.
fn runs_own_code<E>(s: &Slot<E>) -> bool {
    let me = std::ptr::from_ref(s) as usize;
    #[cfg(not(loom))]
    if borrows(|slot, _| slot == me) > 0 {
        return true;
    }
    CURRENT.with(|c| c.get() == me) || TEARING.with(|t| t.get() == me)
}

/// Marks the calling thread as running a slot's teardown while it lives: what the teardown
/// drops (a context, a handler) may hold the last handle of its fabric, whose shutdown must
/// then not wait for callbacks here, one of which may wait for this very teardown.
/// It also names the slot torn down (`TEARING`), restoring the outer one when it ends, even
/// by unwinding.
struct InTeardown {
    prev: usize,
}

impl InTeardown {
    fn enter<E>(s: &Slot<E>) -> Self {
        #[cfg(not(loom))]
        let _ = TEARDOWNS.try_with(|t| t.set(t.get() + 1));
        let prev = TEARING.with(|t| t.replace(std::ptr::from_ref(s) as usize));
        InTeardown { prev }
    }
}

impl Drop for InTeardown {
    fn drop(&mut self) {
        #[cfg(not(loom))]
        let _ = TEARDOWNS.try_with(|t| t.set(t.get().saturating_sub(1)));
        TEARING.with(|t| t.set(self.prev));
    }
}

/// Whether the calling thread is running a slot's teardown.
#[cfg(not(loom))]
pub(crate) fn in_teardown() -> bool {
    TEARDOWNS.try_with(|t| t.get() > 0).unwrap_or(false)
}

/// Whether a callback of the slot whose state `g` is, or code entered as one
/// ([`Slot::try_enter`]), runs on the calling thread: waiting for its destruction here would
/// wait for this thread.
fn runs_here<E>(g: &Inner<E>) -> bool {
    g.running == Some(sync::thread::current().id())
}

fn current_is<E>(s: &Slot<E>) -> bool {
    CURRENT.with(|c| c.get() == std::ptr::from_ref(s) as usize)
}

impl<E: Send + 'static> Slot<E> {
    pub(crate) fn new(target: Target<E>, sched: Arc<dyn Scheduler<E>>) -> Arc<Self> {
        Arc::new(Slot {
            inner: Mutex::new(Inner {
                phase: Phase::Live,
                queue: VecDeque::new(),
                scheduled: false,
                running: None,
                held: 0,
                teardown_started: false,
                removal_queued: false,
                deferred: false,
                extra: None,
                waiters: 0,
                gate_wait: GateWait::No,
            }),
            cond: Condvar::new(),
            target: Mutex::new(Some(target)),
            sched,
            owner: Mutex::new(None),
        })
    }

    /// Records what this slot belongs to; its teardown runs when the slot is torn down.
    pub(crate) fn set_owner(&self, o: std::sync::Arc<dyn SlotOwner>) {
        *sync::lock(&self.owner) = Some(o);
    }

    /// What this slot belongs to, until its teardown.
    pub(crate) fn owner(&self) -> Option<std::sync::Arc<dyn std::any::Any + Send + Sync>> {
        let o = sync::lock(&self.owner).clone();
        o.map(SlotOwner::as_any)
    }

    /// A clone of the target (children inherit their listener's).
    pub(crate) fn target_clone(&self) -> Option<Target<E>> {
        self.target()
    }

    pub(crate) fn phase(&self) -> Phase {
        sync::lock(&self.inner).phase
    }

    pub(crate) fn is_live(&self) -> bool {
        self.phase() == Phase::Live
    }

    fn target(&self) -> Option<Target<E>> {
        sync::lock(&self.target).clone()
    }

    /// The channel, if the target is one. Never clones a callback: a clone held outside a
    /// callback could outlive the teardown and drop the handler after `destroy` returned.
    pub(crate) fn channel(&self) -> Option<Arc<ChannelCore<E>>> {
        match sync::lock(&self.target).as_ref() {
            Some(Target::Channel(ch)) => Some(ch.clone()),
            _ => None,
        }
    }

    /// Queues an event. Discarded (and handed to `discard`) once the slot is not live.
    pub(crate) fn push(self: &Arc<Self>, ev: E) {
        self.push_inner(ev, false);
    }

    /// Queues a device-removal event: at most once, after the callback in flight, replacing
    /// whatever was still queued; never if the slot is being destroyed.
    pub(crate) fn push_removal(self: &Arc<Self>, ev: E) -> bool {
        self.push_inner(ev, true)
    }

    fn push_inner(self: &Arc<Self>, ev: E, removal: bool) -> bool {
        // The target stays locked, not cloned, while the event is queued: a clone of the
        // callback held here could outlive a concurrent teardown and drop the handler (and
        // what it captured) on this thread after `destroy` returned `Done`; and a channel push
        // must not land on the channel a concurrent `migrate` has just left. Lock order:
        // target, inner, channel queue.
        let target = sync::lock(&self.target);
        let mut g = sync::lock(&self.inner);
        // Nothing follows a DeviceRemoval: an engine event routed just before the removal
        // (checked against the id's state, then pushed after the removal was queued) is
        // discarded here, where the order is decided.
        if g.phase != Phase::Live || g.removal_queued || target.is_none() {
            drop(g);
            drop(target);
            self.discard(ev);
            return false;
        }
        let mut dropped = Vec::new();
        if removal {
            g.removal_queued = true;
            dropped.extend(g.queue.drain(..));
        }
        match target.as_ref() {
            Some(Target::Channel(ch)) => {
                drop(g);
                if removal {
                    dropped.extend(ch.purge(self));
                }
                ch.push(self.clone(), ev);
                drop(target);
            }
            Some(Target::Callback(_)) => {
                drop(target);
                g.queue.push_back(ev);
                let schedule = !g.scheduled && g.running.is_none();
                if schedule {
                    g.scheduled = true;
                }
                drop(g);
                if schedule {
                    self.sched.schedule(self.clone());
                }
            }
            None => drop(target),
        }
        for d in dropped {
            self.discard(d);
        }
        true
    }

    /// Hands a queued event that will not be delivered to the scheduler's `discard`. If it
    /// was to enter another slot (`Scheduler::gate`), this slot may have been the one that
    /// slot's last callback handed off to (`hand_off`): the turn goes on to the next.
    fn discard(&self, ev: E) {
        let gate = self.sched.gate(&ev);
        self.sched.discard(ev);
        if let Some(gate) = gate {
            hand_off(&gate);
        }
    }

    /// Runs queued callbacks one at a time until the queue is empty (the scheduler's job).
    pub(crate) fn drain(self: &Arc<Self>) {
        loop {
            let mut g = sync::lock(&self.inner);
            if g.phase != Phase::Live || g.queue.is_empty() {
                g.scheduled = false;
                // An idle id keeps no event buffer: at 100,000 connections the few slots'
                // worth each would otherwise keep is ~20 MB.
                if g.queue.is_empty() && g.queue.capacity() > 0 {
                    g.queue = VecDeque::new();
                }
                let finish = g.phase == Phase::Destroying
                    && g.running.is_none()
                    && g.held == 0
                    && !g.teardown_started;
                if finish {
                    g.teardown_started = true;
                }
                drop(g);
                if finish {
                    self.run_teardown();
                }
                return;
            }
            if g.running.is_some() {
                // Another slot's code runs as this slot's callback (`enter`): its guard
                // schedules the queue again when it drops. Running the callback here would
                // overlap it (and its guard would then mark the slot idle mid-callback).
                g.scheduled = false;
                return;
            }
            let Some(ev) = g.queue.pop_front() else {
                continue;
            };
            // An event delivered as a callback of another slot (a connect request on its
            // listener) waits for that slot's callback in flight parked there, so it holds
            // no thread meanwhile (lock order: this slot, then that one).
            let entry = self
                .sched
                .gate(&ev)
                .map(|gate| gate.try_enter(self, &mut g.gate_wait));
            if let Some(Entry::Parked) = entry {
                g.queue.push_front(ev);
                g.scheduled = false;
                return;
            }
            g.running = Some(sync::thread::current().id());
            drop(g);
            let flow = match entry {
                // That slot is not live: the event dies undelivered, and its slot with it.
                Some(Entry::Closed) => {
                    drop(ev);
                    Flow::Destroy
                }
                entered => match self.target() {
                    Some(Target::Callback(cb)) => self.call(&cb, ev, entered),
                    _ => Flow::Continue,
                },
            };
            let mut g = sync::lock(&self.inner);
            g.running = None;
            let parked = has_parked(&g);
            if (flow == Flow::Destroy || g.deferred) && g.phase == Phase::Live {
                g.phase = Phase::Destroying;
            }
            let mut dropped = Vec::new();
            if g.phase != Phase::Live {
                dropped.extend(g.queue.drain(..));
            }
            let finish = g.phase == Phase::Destroying && g.held == 0 && !g.teardown_started;
            if finish {
                g.teardown_started = true;
            }
            if g.phase != Phase::Live {
                g.scheduled = false;
            }
            let wake = g.waiters > 0;
            drop(g);
            if wake {
                self.cond.notify_all();
            }
            if parked {
                hand_off(self);
            }
            for d in dropped {
                self.discard(d);
            }
            if finish {
                self.run_teardown();
                return;
            }
        }
    }

    /// Runs `cb` for `ev` as this slot's callback; `entered` is the slot the event was
    /// delivered as a callback of (`Scheduler::gate`), left before this callback ends: what
    /// leaving it runs (that slot's teardown, whose drops may destroy this very id) runs as
    /// part of this callback, where such a destroy is deferred instead of waiting for it.
    fn call(&self, cb: &Callback<E>, ev: E, entered: Option<Entry<E>>) -> Flow {
        let prev = CURRENT.with(|c| c.replace(std::ptr::from_ref(self) as usize));
        let owner = self.owner();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(owner, ev)));
        drop(entered);
        CURRENT.with(|c| c.set(prev));
        r.unwrap_or_else(|_| {
            // A panicking callback cannot be trusted with its id any more.
            eprintln!("rcm: a callback panicked; destroying its id");
            Flow::Destroy
        })
    }

    /// Destroys the slot. With `block`, waits for a callback in flight on another thread
    /// (unless the caller is inside a callback itself). Fails, changing nothing, when a
    /// blocking destroy would wait for channel events the caller still holds.
    pub(crate) fn destroy(self: &Arc<Self>, block: bool) -> Result<DestroyOutcome, usize> {
        let mut g = sync::lock(&self.inner);
        match g.phase {
            Phase::Destroyed => return Ok(DestroyOutcome::Done),
            Phase::Destroying => {
                if !block || in_callback() || tearing_down() || runs_own_code(self) || runs_here(&g)
                {
                    return Ok(DestroyOutcome::Deferred);
                }
                // Waiting for held events the caller may hold itself would hang (as in `Live`).
                if g.held > 0 {
                    return Err(g.held as usize);
                }
                if g.phase != Phase::Destroyed {
                    drop(g);
                    before_blocking();
                    g = sync::lock(&self.inner);
                }
                while g.phase != Phase::Destroyed {
                    g = self.wait(g);
                }
                return Ok(DestroyOutcome::Done);
            }
            Phase::Live => {}
        }
        if block && g.held > 0 {
            return Err(g.held as usize);
        }
        g.phase = Phase::Destroying;
        let dropped: Vec<E> = g.queue.drain(..).collect();
        let own = current_is(self);
        if own {
            g.deferred = true;
        }
        // Code run as a callback of this slot on this thread (a connect request entered
        // through the gate) ends before any teardown can: the guard's drop then runs it.
        let here = runs_here(&g);
        let busy = g.running.is_some() || g.held > 0;
        let start_now = !busy && !g.teardown_started;
        if start_now {
            g.teardown_started = true;
        }
        drop(g);
        if let Some(ch) = self.channel() {
            for d in ch.purge(self) {
                self.sched.discard(d);
            }
        }
        for d in dropped {
            self.discard(d);
        }
        if start_now {
            self.run_teardown();
            return Ok(DestroyOutcome::Done);
        }
        if own || here || !block || in_callback() || tearing_down() || runs_own_code(self) {
            return Ok(DestroyOutcome::Deferred);
        }
        // About to wait (only now: a destroy that waits for nothing leaves this thread's
        // pipelined calls and held datagrams be, so a pipeline's destroys go without waits).
        before_blocking();
        let mut g = sync::lock(&self.inner);
        while g.phase != Phase::Destroyed {
            g = self.wait(g);
        }
        Ok(DestroyOutcome::Done)
    }

    /// Waits on the slot's condition variable, counted in `waiters`.
    fn wait<'a>(&self, mut g: sync::MutexGuard<'a, Inner<E>>) -> sync::MutexGuard<'a, Inner<E>> {
        g.waiters += 1;
        let mut g = sync::wait(&self.cond, g);
        g.waiters -= 1;
        g
    }

    /// `wait` with a bound.
    #[cfg(not(loom))]
    fn wait_timeout<'a>(
        &self,
        mut g: sync::MutexGuard<'a, Inner<E>>,
        d: std::time::Duration,
    ) -> sync::MutexGuard<'a, Inner<E>> {
        g.waiters += 1;
        let mut g = sync::wait_timeout(&self.cond, g, d);
        g.waiters -= 1;
        g
    }

    fn run_teardown(&self) {
        let _in = InTeardown::enter(self);
        // What the teardown drops last is the user's (the context; the handler and what it
        // captured): a panic in its `Drop` must neither leave the slot Destroying (every
        // waiter would hang) nor unwind into the caller's destroy or a dispatcher thread.
        let o = sync::lock(&self.owner).take();
        let owner = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            if let Some(o) = o {
                o.teardown();
            }
        }));
        // Dropping the target drops the handler and whatever it captured: after the last
        // callback, exactly once.
        let t = sync::lock(&self.target).take();
        let target = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(t)));
        if owner.is_err() || target.is_err() {
            eprintln!("rcm: a context or handler panicked while dropped; its id is destroyed");
        }
        let mut g = sync::lock(&self.inner);
        g.phase = Phase::Destroyed;
        // Each parked slot finds this one closed, and its event dies undelivered.
        let Extra { wakers, parked } = g.extra.take().map(|e| *e).unwrap_or_default();
        let wake = g.waiters > 0;
        drop(g);
        if wake {
            self.cond.notify_all();
        }
        for w in wakers {
            w.wake();
        }
        unpark(parked);
    }

    /// Blocks until the slot is destroyed; returns at once inside its own callback or
    /// teardown (the destruction ends after them).
    pub(crate) fn wait_destroyed(&self) {
        if runs_own_code(self) || tearing_down() {
            return;
        }
        let mut g = sync::lock(&self.inner);
        if runs_here(&g) {
            return;
        }
        while g.phase != Phase::Destroyed {
            g = self.wait(g);
        }
    }

    /// Like `wait_destroyed` with a bound; returns whether it was destroyed.
    #[cfg(not(loom))]
    pub(crate) fn wait_destroyed_for(&self, d: std::time::Duration) -> bool {
        let end = rcm_proto::later(std::time::Instant::now(), d);
        let mut g = sync::lock(&self.inner);
        if runs_own_code(self) || tearing_down() || runs_here(&g) {
            return g.phase == Phase::Destroyed;
        }
        while g.phase != Phase::Destroyed {
            let now = std::time::Instant::now();
            if now >= end {
                return false;
            }
            g = self.wait_timeout(g, end - now);
        }
        true
    }

    /// Registers a waker for async completion; returns true if already destroyed.
    pub(crate) fn poll_destroyed(&self, w: &Waker) -> bool {
        let mut g = sync::lock(&self.inner);
        if g.phase == Phase::Destroyed {
            return true;
        }
        let wakers = &mut extra(&mut g).wakers;
        if !wakers.iter().any(|x| x.will_wake(w)) {
            wakers.push(w.clone());
        }
        false
    }

    /// Runs code of another slot's event (`who`'s) as if it were a callback of this slot:
    /// marks this slot running until the guard drops, so this slot's blocking destroy waits
    /// for it (a connect request is serialised with its listener, as Linux delivers it
    /// under the listener's handler mutex). While a callback of this slot runs, `who` is
    /// parked here instead, and scheduled in its turn (`hand_off`): parked slots go in in the
    /// order they parked, a newcomer that finds this slot idle at once (see
    /// `GateWait::Turn`). `Closed` once the slot is not live. `wait` is `who`'s `gate_wait`,
    /// its lock held by the caller.
    pub(crate) fn try_enter(self: &Arc<Self>, who: &Arc<Slot<E>>, wait: &mut GateWait) -> Entry<E> {
        let mut g = sync::lock(&self.inner);
        if g.phase != Phase::Live {
            return Entry::Closed;
        }
        if g.running.is_some() {
            match *wait {
                GateWait::Turn => extra(&mut g).parked.push_front(who.clone()),
                GateWait::No => extra(&mut g).parked.push_back(who.clone()),
                // Listed already.
                GateWait::Parked => {}
            }
            *wait = GateWait::Parked;
            return Entry::Parked;
        }
        // A slot still listed that goes in (scheduled by something else) stays listed until
        // a hand-off takes it, which then finds it not waiting and passes it by.
        if *wait == GateWait::Turn {
            *wait = GateWait::No;
        }
        g.running = Some(sync::thread::current().id());
        Entry::Entered(EnterGuard(self.clone()))
    }

    /// Takes a channel hold on this slot (a held event of another slot that also belongs to
    /// this one, such as a connect request on its listener). False once not live.
    pub(crate) fn hold_for_other(&self) -> bool {
        self.hold()
    }

    /// A channel event was handed out.
    fn hold(&self) -> bool {
        let mut g = sync::lock(&self.inner);
        if g.phase != Phase::Live {
            return false;
        }
        g.held += 1;
        true
    }

    /// A held channel event was dropped (acked).
    pub(crate) fn ack(&self) {
        let mut g = sync::lock(&self.inner);
        g.held = g.held.saturating_sub(1);
        let finish = g.held == 0
            && g.phase == Phase::Destroying
            && g.running.is_none()
            && !g.teardown_started;
        if finish {
            g.teardown_started = true;
        }
        let wake = g.waiters > 0;
        drop(g);
        if wake {
            self.cond.notify_all();
        }
        if finish {
            self.run_teardown();
        }
    }

    /// A fabric shutting down tears down a slot being destroyed that only its held events
    /// keep waiting (their acks then find the teardown done): its peer must hear of the
    /// end before the devices stop, and the events stay readable.
    #[cfg(not(loom))]
    pub(crate) fn tear_down_despite_held(&self) {
        let mut g = sync::lock(&self.inner);
        let now = g.phase == Phase::Destroying
            && g.held > 0
            && g.running.is_none()
            && !g.teardown_started;
        if now {
            g.teardown_started = true;
        }
        drop(g);
        if now {
            self.run_teardown();
        }
    }

    /// Moves the slot to another channel: events not yet taken move with it, in order.
    pub(crate) fn migrate(self: &Arc<Self>, to: &Arc<ChannelCore<E>>) -> Result<(), Unmoved> {
        let mut t = sync::lock(&self.target);
        let from = match t.as_ref() {
            Some(Target::Channel(from)) => from,
            Some(Target::Callback(_)) => return Err(Unmoved::NotChannel),
            // Only the teardown takes the target: a destroy got there first, after the
            // caller last saw the slot live.
            None => return Err(Unmoved::TornDown),
        };
        if Arc::ptr_eq(from, to) {
            return Ok(());
        }
        // A destroy marks the slot before it reads the channel to purge: one that began
        // before this move would purge the old channel after it, and leave the moved events
        // queued on the new one for good.
        if sync::lock(&self.inner).phase != Phase::Live {
            return Err(Unmoved::TornDown);
        }
        let moved = from.purge(self);
        *t = Some(Target::Channel(to.clone()));
        // Moved while the target is still locked, so a concurrent push queues behind them.
        for ev in moved {
            to.push(self.clone(), ev);
        }
        drop(t);
        Ok(())
    }
}

impl<E: Send + 'static> Slot<E> {
    /// Moves a listener's child to the listener's new channel with its connect request not
    /// yet handed out (queued, or to come). A child whose request a reader of the old channel
    /// took meanwhile (held now) stays: the application got it there. False when it stayed.
    pub(crate) fn migrate_unseen(self: &Arc<Self>, to: &Arc<ChannelCore<E>>) -> bool {
        let mut t = sync::lock(&self.target);
        let Some(Target::Channel(from)) = t.as_ref() else {
            return false;
        };
        if Arc::ptr_eq(from, to) {
            return true;
        }
        // As in `migrate`: a child being destroyed stays where its destroy purges.
        if sync::lock(&self.inner).phase != Phase::Live {
            return false;
        }
        // The purge takes the old channel's queue lock, which a reader holds while it takes an
        // event and holds its slot: after it, a request not among these is held already.
        let moved = from.purge(self);
        if moved.is_empty() && sync::lock(&self.inner).held > 0 {
            return false;
        }
        *t = Some(Target::Channel(to.clone()));
        for ev in moved {
            to.push(self.clone(), ev);
        }
        true
    }
}

/// Why `Slot::migrate` moved nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unmoved {
    /// The slot's events go to a callback.
    NotChannel,
    /// The slot was torn down.
    TornDown,
}

/// What [`Slot::try_enter`] did.
pub(crate) enum Entry<E: Send + 'static> {
    /// Entered, until the guard drops.
    #[allow(dead_code)] // Held for its drop.
    Entered(EnterGuard<E>),
    /// A callback of the slot runs: the caller was parked on it.
    Parked,
    /// The slot is not live.
    Closed,
}

/// The boxed part of `g`, made if missing.
fn extra<E>(g: &mut Inner<E>) -> &mut Extra<E> {
    g.extra.get_or_insert_with(Box::default)
}

/// Whether a slot is parked on `g`'s callback. Read under the lock that ends the callback:
/// none can park after it (the slot is no longer running), so a callback end with nothing
/// parked skips `hand_off` and its second lock of the slot.
fn has_parked<E>(g: &Inner<E>) -> bool {
    g.extra.as_ref().is_some_and(|e| !e.parked.is_empty())
}

/// The next slot parked on `g`'s callback (freeing the box once nothing is in it).
fn next_parked<E>(g: &mut Inner<E>) -> Option<Arc<Slot<E>>> {
    let e = g.extra.as_mut()?;
    let next = e.parked.pop_front();
    if e.parked.is_empty() && e.wakers.is_empty() {
        g.extra = None;
    }
    next
}

/// A callback of `gate` ended, or a slot it handed off to will not come: schedules the
/// first slot parked on it that still waits to go in (live, its event queued, not already
/// scheduled), dropping from the list those that do not. Only one: while it runs as the
/// gate's callback the others could only park again, and its end hands off in turn. Does
/// nothing while a callback of the gate runs (its end hands off), and schedules every parked
/// slot once the gate is not live (each then finds it closed).
///
/// Every entry stays listed until a hand-off takes it, so a slot parks again (`try_enter`)
/// if it was scheduled by something else meanwhile and the gate is still busy. Lock order:
/// a parked slot before its gate, so the gate's lock is let go before each is looked at.
fn hand_off<E: Send + 'static>(gate: &Arc<Slot<E>>) {
    loop {
        let mut g = sync::lock(&gate.inner);
        let closed = g.phase != Phase::Live;
        if g.running.is_some() && !closed {
            return;
        }
        let Some(p) = next_parked(&mut g) else {
            return;
        };
        drop(g);
        if wake_parked(&p) && !closed {
            return;
        }
    }
}

/// Schedules `p`, taken from a gate's parked list, if it still waits to go in, and gives
/// it the turn. Returns whether it was scheduled here: one scheduled by something else
/// may not come for this gate (it went in already, its event delivered), so the turn
/// goes on to the next; if it does come and finds the gate busy, it parks again.
fn wake_parked<E: Send + 'static>(p: &Arc<Slot<E>>) -> bool {
    let mut g = sync::lock(&p.inner);
    let go = g.phase == Phase::Live && !g.queue.is_empty() && !g.scheduled;
    g.gate_wait = if go { GateWait::Turn } else { GateWait::No };
    if go {
        g.scheduled = true;
    }
    drop(g);
    if go {
        p.sched.schedule(p.clone());
    }
    go
}

/// Schedules every slot that was parked on a gate now closed.
fn unpark<E: Send + 'static>(parked: VecDeque<Arc<Slot<E>>>) {
    for p in parked {
        wake_parked(&p);
    }
}

/// See [`Slot::try_enter`].
pub(crate) struct EnterGuard<E: Send + 'static>(Arc<Slot<E>>);

impl<E: Send + 'static> Drop for EnterGuard<E> {
    fn drop(&mut self) {
        let s = &self.0;
        let mut g = sync::lock(&s.inner);
        g.running = None;
        let parked = has_parked(&g);
        let finish = g.phase == Phase::Destroying && g.held == 0 && !g.teardown_started;
        if finish {
            g.teardown_started = true;
        }
        // Events pushed meanwhile were left for the running "callback": schedule them.
        let schedule = g.phase == Phase::Live && !g.queue.is_empty() && !g.scheduled;
        if schedule {
            g.scheduled = true;
        }
        let wake = g.waiters > 0;
        drop(g);
        if wake {
            s.cond.notify_all();
        }
        if parked {
            hand_off(s);
        }
        if finish {
            s.run_teardown();
        }
        if schedule {
            s.sched.schedule(s.clone());
        }
    }
}

/// Where one slot's events sit in a channel's queue (their sequence numbers, oldest
/// first); one is the usual case and costs no allocation.
enum Places {
    One(u64),
    Many(VecDeque<u64>),
}

/// A channel's events in order, indexed by slot: a destroyed id's events are taken out
/// where they are, without walking the queue. (A walk per destroy made destroying many ids
/// quadratic while events of others waited unread: 100,000 ids destroyed through a daemon,
/// their TIMEWAIT_EXITs arriving meanwhile, took ~1 ms each.)
struct ChannelQueue<E> {
    /// Taken entries stay as `None` until they reach the front.
    items: VecDeque<Option<(Arc<Slot<E>>, E)>>,
    /// Sequence number of `items[0]`.
    head: u64,
    /// Entries that are `Some`.
    live: usize,
    /// By slot address: an entry holds its slot, so no other slot has that address while
    /// the slot has places here.
    places: foldhash::HashMap<usize, Places>,
}

impl<E> ChannelQueue<E> {
    fn new() -> Self {
        ChannelQueue {
            items: VecDeque::new(),
            head: 0,
            live: 0,
            places: foldhash::HashMap::default(),
        }
    }

    fn key(s: &Slot<E>) -> usize {
        std::ptr::from_ref(s).addr()
    }

    fn push(&mut self, s: Arc<Slot<E>>, ev: E) {
        let seq = self.head + self.items.len() as u64;
        match self.places.entry(Self::key(&s)) {
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(Places::One(seq));
            }
            std::collections::hash_map::Entry::Occupied(mut e) => match e.get_mut() {
                Places::One(first) => {
                    let first = *first;
                    e.insert(Places::Many(VecDeque::from([first, seq])));
                }
                Places::Many(v) => v.push_back(seq),
            },
        }
        self.items.push_back(Some((s, ev)));
        self.live += 1;
    }

    fn pop_front(&mut self) -> Option<(Arc<Slot<E>>, E)> {
        while let Some(item) = self.items.pop_front() {
            self.head += 1;
            let Some((s, ev)) = item else { continue };
            self.live -= 1;
            // The oldest place of its slot is this one.
            let k = Self::key(&s);
            if let Some(p) = self.places.get_mut(&k) {
                let last = match p {
                    Places::One(_) => true,
                    Places::Many(v) => {
                        v.pop_front();
                        v.is_empty()
                    }
                };
                if last {
                    self.places.remove(&k);
                }
            }
            self.give_back_room();
            return Some((s, ev));
        }
        None
    }

    /// Once emptied, a burst's queue gives its room back (`rcm_proto::room`): a channel
    /// that once had 100,000 events unread kept ~12 MB for good.
    fn give_back_room(&mut self) {
        if self.items.is_empty() {
            rcm_proto::room::shrink_deque(&mut self.items);
            rcm_proto::room::shrink_map(&mut self.places);
        }
    }

    /// Moves the event with sequence number `seq` (if still queued) to `out`.
    fn take_at(&mut self, seq: u64, out: &mut Vec<E>) {
        let at = seq
            .checked_sub(self.head)
            .and_then(|d| usize::try_from(d).ok())
            .unwrap_or(usize::MAX);
        if let Some((_, ev)) = self.items.get_mut(at).and_then(Option::take) {
            out.push(ev);
            self.live -= 1;
        }
    }

    /// Takes out every event of `s`, in order.
    fn remove_slot(&mut self, s: &Slot<E>) -> Vec<E> {
        let mut out = Vec::new();
        match self.places.remove(&Self::key(s)) {
            None => return out,
            Some(Places::One(seq)) => self.take_at(seq, &mut out),
            Some(Places::Many(seqs)) => {
                for seq in seqs {
                    self.take_at(seq, &mut out);
                }
            }
        }
        while matches!(self.items.front(), Some(None)) {
            self.items.pop_front();
            self.head += 1;
        }
        self.give_back_room();
        out
    }
}

#[cfg(not(loom))]
use crate::remote::BusyPoll;

/// Until when a taker waits: `None` forever, zero not at all. The instant is read from the
/// clock only once a wait begins (a taker that finds an event queued reads none), and
/// then kept, so that takes that follow one another share one deadline.
#[cfg(not(loom))]
pub(crate) struct Deadline {
    timeout: Option<std::time::Duration>,
    at: Option<std::time::Instant>,
}

#[cfg(not(loom))]
impl Deadline {
    pub(crate) fn new(timeout: Option<std::time::Duration>) -> Self {
        Deadline { timeout, at: None }
    }

    /// Not waiting at all.
    pub(crate) fn now() -> Self {
        Self::new(Some(std::time::Duration::ZERO))
    }

    fn is_now(&self) -> bool {
        self.timeout == Some(std::time::Duration::ZERO)
    }

    fn at(&mut self) -> Option<std::time::Instant> {
        let t = self.timeout?;
        Some(
            *self
                .at
                .get_or_insert_with(|| rcm_proto::later(std::time::Instant::now(), t)),
        )
    }
}

#[cfg(not(loom))]
std::thread_local! {
    /// What this thread polled last while waiting for an event (see `BusyPoll::kick`).
    static LEFT_ASIDE: std::cell::RefCell<Option<std::sync::Weak<dyn BusyPoll>>> =
        const { std::cell::RefCell::new(None) };
}

/// This thread is about to wait polling `next` (or, `None`, without polling): what it
/// polled last, if something else, gets its receiving thread back now.
#[cfg(not(loom))]
fn left_aside(next: Option<&Arc<dyn BusyPoll>>) {
    let Ok(Some(prev)) = LEFT_ASIDE.try_with(std::cell::RefCell::take) else {
        return;
    };
    if let Some(n) = next {
        if std::ptr::addr_eq(prev.as_ptr(), Arc::as_ptr(n)) {
            return;
        }
    }
    if let Some(p) = prev.upgrade() {
        p.kick();
    }
}

/// This thread called into something that is not what it polled last (its busy-poll hint
/// moved to `next`): that one's receiving thread, if still standing aside for nobody, gets
/// its socket back now rather than at this thread's next wait, so that what comes for it
/// meanwhile (the answer to a call on the other side of a connection, say) is received.
#[cfg(not(loom))]
pub(crate) fn hint_moved(next: *const ()) {
    let _ = LEFT_ASIDE.try_with(|l| {
        let Ok(mut l) = l.try_borrow_mut() else {
            return;
        };
        if l.as_ref()
            .is_some_and(|p| !std::ptr::addr_eq(p.as_ptr(), next))
        {
            if let Some(p) = l.take().and_then(|p| p.upgrade()) {
                drop(l);
                p.kick();
            }
        }
    });
}

/// The queue behind an event channel.
pub(crate) struct ChannelCore<E> {
    q: Mutex<ChannelQueue<E>>,
    cond: Condvar,
    /// Events in `q`, for a taker polling without the lock.
    queued: std::sync::atomic::AtomicUsize,
    /// How long a waiting taker polls before it sleeps (see `FabricConfig::spin`).
    spin: std::sync::atomic::AtomicU64,
    /// Takers asleep on `cond` (changed and read under `q`'s lock).
    waiting: std::sync::atomic::AtomicUsize,
}

impl<E: Send + 'static> ChannelCore<E> {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(ChannelCore {
            q: Mutex::new(ChannelQueue::new()),
            cond: Condvar::new(),
            queued: std::sync::atomic::AtomicUsize::new(0),
            spin: std::sync::atomic::AtomicU64::new(DEFAULT_CHANNEL_SPIN_NS),
            waiting: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// Sets how long a waiting taker polls before it sleeps.
    pub(crate) fn set_spin(&self, d: std::time::Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.spin.store(ns, std::sync::atomic::Ordering::Relaxed);
    }

    fn push(&self, s: Arc<Slot<E>>, ev: E) {
        use std::sync::atomic::Ordering::Relaxed;
        let mut q = sync::lock(&self.q);
        q.push(s, ev);
        self.queued.store(q.live, Relaxed);
        // Read under the lock the takers count themselves under: no wake-up call when
        // nobody sleeps (a polling taker sees `queued`).
        let wake = self.waiting.load(Relaxed) > 0;
        drop(q);
        if wake {
            self.cond.notify_one();
        }
    }

    /// Removes and returns every queued event of `s`.
    fn purge(&self, s: &Slot<E>) -> Vec<E> {
        let mut q = sync::lock(&self.q);
        let out = q.remove_slot(s);
        self.queued
            .store(q.live, std::sync::atomic::Ordering::Relaxed);
        out
    }

    /// Takes the next event of a live slot, marking it held; waits until `deadline` (see
    /// [`Deadline`]). While it polls before sleeping, what `busy` names (asked then, if the
    /// taker polls) is polled too: the device that will most likely bring the event (see
    /// `BusyPoll`).
    #[cfg(not(loom))]
    pub(crate) fn take(
        &self,
        deadline: &mut Deadline,
        busy: impl FnOnce() -> Option<Arc<dyn BusyPoll>>,
    ) -> Option<(Arc<Slot<E>>, E)> {
        use std::sync::atomic::Ordering::Relaxed;
        let mut busy = Some(busy);
        let mut q = sync::lock(&self.q);
        let mut polled = false;
        loop {
            while let Some((s, ev)) = q.pop_front() {
                self.queued.store(q.live, Relaxed);
                if s.hold() {
                    return Some((s, ev));
                }
                drop(q);
                s.sched.discard(ev);
                q = sync::lock(&self.q);
            }
            if deadline.is_now() {
                return None;
            }
            let end = deadline.at();
            if !polled {
                // Poll a while before sleeping: a sleeping taker costs the event tens of µs.
                polled = true;
                // None while this thread is held off polling (see `spin`): a poll that
                // would end at once must not ask the device's thread to stand aside.
                let mut spin = crate::spin::spin_budget(std::time::Duration::from_nanos(
                    self.spin.load(Relaxed),
                ));
                if let Some(e) = end {
                    spin = spin.min(e.saturating_duration_since(std::time::Instant::now()));
                }
                if !spin.is_zero() {
                    drop(q);
                    let queued = || self.queued.load(Relaxed) > 0;
                    if let Some(b) = busy.take().and_then(|f| f()) {
                        left_aside(Some(&b));
                        b.begin(spin);
                        crate::spin::spin_until(spin, || {
                            if queued() {
                                return true;
                            }
                            if !b.poll() {
                                return false;
                            }
                            // What the handling sent is held if this thread holds a
                            // `SendBatch` (the RTU of a connection whose REP this poll
                            // brought, with a QP attached): it goes out at this thread's
                            // next wait, after its event is taken, when one came; now, as
                            // before any wait, when it goes on waiting.
                            queued() || {
                                crate::fabric::before_wait();
                                false
                            }
                        });
                        b.end();
                        LEFT_ASIDE.with(|l| l.replace(Some(Arc::downgrade(&b))));
                    } else {
                        left_aside(None);
                        crate::spin::spin_until(spin, queued);
                    }
                    q = sync::lock(&self.q);
                    continue;
                }
            }
            left_aside(None);
            // Never asleep holding datagrams: a poll above may have left some held (its
            // event was taken to be this waiter's, then turned out to be a destroyed id's
            // and was dropped), and nothing else would send them before an event wakes us.
            // Sent without the queue's lock, which is then looked at again.
            if crate::device::holding() || crate::remote::owes_answers() {
                drop(q);
                crate::fabric::before_wait();
                q = sync::lock(&self.q);
                continue;
            }
            self.waiting.fetch_add(1, Relaxed);
            match end {
                None => q = sync::wait(&self.cond, q),
                Some(e) => {
                    let now = std::time::Instant::now();
                    if now >= e {
                        self.waiting.fetch_sub(1, Relaxed);
                        return None;
                    }
                    q = sync::wait_timeout(&self.cond, q, e - now);
                }
            }
            self.waiting.fetch_sub(1, Relaxed);
        }
    }

    /// Takes the next event without waiting (loom models use this).
    #[cfg(loom)]
    pub(crate) fn try_take(&self) -> Option<(Arc<Slot<E>>, E)> {
        let mut q = sync::lock(&self.q);
        while let Some((s, ev)) = q.pop_front() {
            self.queued
                .store(q.live, std::sync::atomic::Ordering::Relaxed);
            if s.hold() {
                return Some((s, ev));
            }
            drop(q);
            s.sched.discard(ev);
            q = sync::lock(&self.q);
        }
        None
    }

    /// Events queued (live or not).
    pub(crate) fn len(&self) -> usize {
        sync::lock(&self.q).live
    }
}

/// Test support for the loom models in `tests/loom.rs`, built only with `--cfg loom`: a public
/// face over the crate-private core. Thin wrappers only; not part of the API.
#[cfg(loom)]
pub mod loom_api {
    use super::{ChannelCore, DestroyOutcome, Flow, Scheduler, Slot, Target};
    use std::sync::{Arc, Weak};
    use std::task::Waker;

    /// A slot's lifecycle phase.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Phase {
        /// Callbacks may run.
        Live,
        /// No callback starts any more; the teardown has not completed.
        Destroying,
        /// Torn down.
        Destroyed,
    }

    type GateFn<E> = Box<dyn Fn(&E) -> Option<SlotHandle<E>> + Send + Sync>;

    struct FnSched<E>(
        Box<dyn Fn(SlotHandle<E>) + Send + Sync>,
        fn(E),
        Option<GateFn<E>>,
    );

    impl<E> Scheduler<E> for FnSched<E> {
        fn schedule(&self, slot: Arc<Slot<E>>) {
            (self.0)(SlotHandle(slot));
        }
        fn discard(&self, ev: E) {
            (self.1)(ev);
        }
        fn gate(&self, ev: &E) -> Option<Arc<Slot<E>>> {
            self.2.as_ref().and_then(|g| g(ev)).map(|h| h.0)
        }
    }

    /// A teardown closure as a slot's owner.
    struct ClosureOwner(std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>);

    impl super::SlotOwner for ClosureOwner {
        fn teardown(self: std::sync::Arc<Self>) {
            let f = self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            if let Some(f) = f {
                f();
            }
        }
        fn as_any(self: std::sync::Arc<Self>) -> std::sync::Arc<dyn std::any::Any + Send + Sync> {
            self
        }
    }

    /// A shared handle on one slot.
    pub struct SlotHandle<E>(Arc<Slot<E>>);

    impl<E> Clone for SlotHandle<E> {
        fn clone(&self) -> Self {
            SlotHandle(self.0.clone())
        }
    }

    /// A weak handle on a slot (for callbacks that refer to slots without keeping them alive).
    pub struct WeakSlot<E>(Weak<Slot<E>>);

    impl<E> Clone for WeakSlot<E> {
        fn clone(&self) -> Self {
            WeakSlot(self.0.clone())
        }
    }

    impl<E> WeakSlot<E> {
        /// The slot, if it still exists.
        pub fn upgrade(&self) -> Option<SlotHandle<E>> {
            self.0.upgrade().map(SlotHandle)
        }
    }

    /// Whether the calling thread is inside some slot's callback.
    pub fn in_callback() -> bool {
        super::in_callback()
    }

    impl<E: Send + 'static> SlotHandle<E> {
        /// A callback-mode slot: `cb` gets its events; `sched` is called whenever the slot is
        /// scheduled and must (eventually) call [`SlotHandle::drain`] once — calling it
        /// directly is an inline scheduler.
        pub fn with_callback(
            cb: impl Fn(E) -> Flow + Send + Sync + 'static,
            sched: impl Fn(SlotHandle<E>) + Send + Sync + 'static,
            discard: fn(E),
        ) -> Self {
            Self::callback_slot(cb, sched, discard, None)
        }

        /// As [`SlotHandle::with_callback`], with `gate` naming the slot an event must be
        /// delivered serialised with (`Scheduler::gate`: a connect request's listener).
        pub fn with_callback_gated(
            cb: impl Fn(E) -> Flow + Send + Sync + 'static,
            sched: impl Fn(SlotHandle<E>) + Send + Sync + 'static,
            discard: fn(E),
            gate: impl Fn(&E) -> Option<SlotHandle<E>> + Send + Sync + 'static,
        ) -> Self {
            Self::callback_slot(cb, sched, discard, Some(Box::new(gate)))
        }

        fn callback_slot(
            cb: impl Fn(E) -> Flow + Send + Sync + 'static,
            sched: impl Fn(SlotHandle<E>) + Send + Sync + 'static,
            discard: fn(E),
            gate: Option<GateFn<E>>,
        ) -> Self {
            let cb: super::Callback<E> = Arc::new(move |_owner, ev| cb(ev));
            SlotHandle(Slot::new(
                Target::Callback(cb),
                Arc::new(FnSched(Box::new(sched), discard, gate)),
            ))
        }

        /// A channel-mode slot whose events go to `ch`.
        pub fn with_channel(ch: &Channel<E>, discard: fn(E)) -> Self {
            SlotHandle(Slot::new(
                Target::Channel(ch.0.clone()),
                Arc::new(FnSched(Box::new(|_| {}), discard, None)),
            ))
        }

        /// Sets the teardown closure (the slot's owner is then that closure).
        pub fn set_teardown(&self, f: impl FnOnce() + Send + 'static) {
            self.0
                .set_owner(std::sync::Arc::new(ClosureOwner(std::sync::Mutex::new(
                    Some(Box::new(f)),
                ))));
        }

        /// `Slot::push`.
        pub fn push(&self, ev: E) {
            self.0.push(ev);
        }

        /// `Slot::push_removal`.
        pub fn push_removal(&self, ev: E) -> bool {
            self.0.push_removal(ev)
        }

        /// `Slot::drain` (the scheduler's job).
        pub fn drain(&self) {
            self.0.drain();
        }

        /// `Slot::destroy`.
        pub fn destroy(&self, block: bool) -> Result<DestroyOutcome, usize> {
            self.0.destroy(block)
        }

        /// `Slot::ack`.
        pub fn ack(&self) {
            self.0.ack();
        }

        /// `Slot::migrate`.
        pub fn migrate(&self, to: &Channel<E>) -> bool {
            self.0.migrate(&to.0).is_ok()
        }

        /// `Slot::wait_destroyed`.
        pub fn wait_destroyed(&self) {
            self.0.wait_destroyed();
        }

        /// `Slot::poll_destroyed`.
        pub fn poll_destroyed(&self, w: &Waker) -> bool {
            self.0.poll_destroyed(w)
        }

        /// The slot's phase.
        pub fn phase(&self) -> Phase {
            match self.0.phase() {
                super::Phase::Live => Phase::Live,
                super::Phase::Destroying => Phase::Destroying,
                super::Phase::Destroyed => Phase::Destroyed,
            }
        }

        /// A weak handle.
        pub fn downgrade(&self) -> WeakSlot<E> {
            WeakSlot(Arc::downgrade(&self.0))
        }

        /// Whether both handles are the same slot.
        pub fn ptr_eq(&self, other: &Self) -> bool {
            Arc::ptr_eq(&self.0, &other.0)
        }
    }

    /// An event channel's queue.
    pub struct Channel<E>(Arc<ChannelCore<E>>);

    impl<E> Clone for Channel<E> {
        fn clone(&self) -> Self {
            Channel(self.0.clone())
        }
    }

    impl<E: Send + 'static> Default for Channel<E> {
        fn default() -> Self {
            Channel(ChannelCore::new())
        }
    }

    impl<E: Send + 'static> Channel<E> {
        /// A new channel.
        pub fn new() -> Self {
            Self::default()
        }

        /// `ChannelCore::try_take`: the next event of a live slot, now held.
        pub fn try_take(&self) -> Option<(SlotHandle<E>, E)> {
            self.0.try_take().map(|(s, e)| (SlotHandle(s), e))
        }

        /// Events queued (live or not).
        pub fn len(&self) -> usize {
            self.0.len()
        }

        /// Whether no event is queued.
        pub fn is_empty(&self) -> bool {
            self.len() == 0
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::{Flow, Scheduler, Slot, Target};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    /// Collects scheduled slots; the test drains them itself.
    #[derive(Default)]
    struct Collect(Mutex<Vec<Arc<Slot<u32>>>>);
    impl Scheduler<u32> for Collect {
        fn schedule(&self, slot: Arc<Slot<u32>>) {
            self.0.lock().unwrap().push(slot);
        }
    }

    /// Once its events ran, an id holds no event buffer (at 100,000 idle ids the buffers
    /// each would keep were ~20 MB), and it still takes and runs new events in order.
    #[test]
    fn a_drained_slot_keeps_no_event_buffer() {
        let sched = Arc::new(Collect::default());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        let calls = Arc::new(AtomicUsize::new(0));
        let c2 = calls.clone();
        let cb: super::Callback<u32> = Arc::new(move |_, ev| {
            s2.lock().unwrap().push(ev);
            c2.fetch_add(1, Ordering::SeqCst);
            Flow::Continue
        });
        let slot = Slot::new(Target::Callback(cb), sched.clone());
        for round in 0..3u32 {
            for i in 0..10 {
                slot.push(round * 10 + i);
            }
            assert!(slot.inner.lock().unwrap().queue.capacity() >= 10);
            let scheduled: Vec<_> = std::mem::take(&mut *sched.0.lock().unwrap());
            assert_eq!(scheduled.len(), 1, "one schedule per idle-to-busy change");
            for s in scheduled {
                s.drain();
            }
            assert_eq!(slot.inner.lock().unwrap().queue.capacity(), 0);
        }
        assert_eq!(calls.load(Ordering::SeqCst), 30);
        assert_eq!(*seen.lock().unwrap(), (0..30).collect::<Vec<u32>>());
    }

    /// A channel's queue gives back the room a burst of unread events took once it is read
    /// to the end, or once the ids whose events filled it are destroyed.
    #[test]
    fn an_emptied_channel_queue_gives_its_room_back() {
        let sched = Arc::new(Collect::default());
        let core = super::ChannelCore::new();
        let slots: Vec<_> = (0..50)
            .map(|_| Slot::new(Target::Channel(core.clone()), sched.clone()))
            .collect();
        let kept = |cap, entry| rcm_proto::room::kept(cap, entry);
        let (item, place) = (
            std::mem::size_of::<Option<(Arc<Slot<u32>>, u32)>>(),
            std::mem::size_of::<(usize, super::Places)>(),
        );
        let mut q = super::ChannelQueue::new();
        for i in 0..5000u32 {
            q.push(slots[i as usize % 50].clone(), i);
        }
        let peak = (q.items.capacity(), q.places.capacity());
        let mut n = 0;
        while let Some((_, ev)) = q.pop_front() {
            assert_eq!(ev, n, "in order");
            n += 1;
        }
        assert_eq!(n, 5000);
        assert!(
            kept(q.items.capacity(), item) && kept(q.places.capacity(), place),
            "room for {} events, {} slots left of {peak:?}",
            q.items.capacity(),
            q.places.capacity()
        );
        for i in 0..5000u32 {
            q.push(slots[i as usize % 50].clone(), i);
        }
        for s in &slots {
            assert_eq!(q.remove_slot(s).len(), 100);
        }
        assert!(
            kept(q.items.capacity(), item) && kept(q.places.capacity(), place),
            "after removals: room for {} events, {} slots",
            q.items.capacity(),
            q.places.capacity()
        );
    }

    /// A migrate that comes after the teardown says so, rather than calling the id a
    /// callback-mode one (bug 1's test once saw that answer in a migrate/destroy race).
    #[test]
    fn migrating_a_torn_down_slot_is_told_apart_from_a_callback_slot() {
        let sched = Arc::new(Collect::default());
        let (from, to) = (super::ChannelCore::new(), super::ChannelCore::new());
        let slot = Slot::new(Target::Channel(from), sched.clone());
        assert_eq!(slot.migrate(&to), Ok(()));
        assert_eq!(
            slot.destroy(true),
            Ok(super::DestroyOutcome::Done),
            "nothing held or running"
        );
        assert_eq!(slot.migrate(&to), Err(super::Unmoved::TornDown));
        let cb: super::Callback<u32> = Arc::new(|_, _| Flow::Continue);
        let slot = Slot::new(Target::Callback(cb), sched);
        assert_eq!(slot.migrate(&to), Err(super::Unmoved::NotChannel));
    }

    /// A deadline is read from the clock once, when a wait first needs it, and then kept;
    /// `None` waits forever and zero not at all.
    #[test]
    fn a_deadline_is_read_once_when_first_needed() {
        use std::time::{Duration, Instant};
        let before = Instant::now();
        let mut d = super::Deadline::new(Some(Duration::from_secs(60)));
        let first = d.at().expect("a deadline");
        assert!(first >= before + Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(d.at(), Some(first), "the deadline moved");
        assert_eq!(super::Deadline::new(None).at(), None);
        assert!(super::Deadline::now().is_now());
        assert!(!d.is_now());
    }

    /// A take with a timeout and nothing queued returns nothing, and not before the timeout;
    /// a queued event is taken at once, whatever the timeout.
    #[test]
    fn a_take_waits_its_timeout_and_no_longer_for_what_is_queued() {
        use std::time::{Duration, Instant};
        let ch = super::ChannelCore::<u32>::new();
        ch.set_spin(Duration::from_millis(1));
        let none = || None;
        let t0 = Instant::now();
        let timeout = Duration::from_millis(30);
        assert!(ch
            .take(&mut super::Deadline::new(Some(timeout)), none)
            .is_none());
        assert!(t0.elapsed() >= timeout, "returned after {:?}", t0.elapsed());
        assert!(ch.take(&mut super::Deadline::now(), none).is_none());
        let sched = Arc::new(Collect::default());
        let slot = Slot::new(Target::Channel(ch.clone()), sched);
        slot.push(7);
        let got = ch.take(&mut super::Deadline::new(None), none);
        assert_eq!(got.map(|(_, e)| e), Some(7));
    }

    /// Events from 1000 up are delivered as callbacks of `gate` (as a connect request is
    /// of its listener); the test drains what is scheduled itself.
    #[derive(Default)]
    struct Gated {
        ready: Mutex<Vec<Arc<Slot<u32>>>>,
        gate: Mutex<Option<Arc<Slot<u32>>>>,
        discarded: Mutex<Vec<u32>>,
    }
    impl Scheduler<u32> for Gated {
        fn schedule(&self, slot: Arc<Slot<u32>>) {
            self.ready.lock().unwrap().push(slot);
        }
        fn discard(&self, ev: u32) {
            self.discarded.lock().unwrap().push(ev);
        }
        fn gate(&self, ev: &u32) -> Option<Arc<Slot<u32>>> {
            (*ev >= 1000)
                .then(|| self.gate.lock().unwrap().clone())
                .flatten()
        }
    }
    impl Gated {
        fn take(&self) -> Vec<Arc<Slot<u32>>> {
            std::mem::take(&mut *self.ready.lock().unwrap())
        }
    }

    /// The scheduler, the listener, its children, the entry that holds the listener busy,
    /// and the events that ran.
    type Parked = (
        Arc<Gated>,
        Arc<Slot<u32>>,
        Vec<Arc<Slot<u32>>>,
        super::Entry<u32>,
        Arc<Mutex<Vec<u32>>>,
    );

    /// A listener whose callback is held running (entered as another slot's would be), and
    /// `n` children each with a gated event, parked on it.
    fn parked_children(n: u32) -> Parked {
        let sched = Arc::new(Gated::default());
        let ran = Arc::new(Mutex::new(Vec::new()));
        let r = ran.clone();
        let cb: super::Callback<u32> = Arc::new(move |_, ev| {
            r.lock().unwrap().push(ev);
            Flow::Continue
        });
        let listener = Slot::new(Target::Callback(cb.clone()), sched.clone());
        *sched.gate.lock().unwrap() = Some(listener.clone());
        let holder = Slot::new(Target::Callback(cb.clone()), sched.clone());
        let held = listener.try_enter(&holder, &mut super::GateWait::No);
        assert!(matches!(held, super::Entry::Entered(_)));
        let children: Vec<_> = (0..n)
            .map(|_| Slot::new(Target::Callback(cb.clone()), sched.clone()))
            .collect();
        for (i, c) in (0..).zip(&children) {
            c.push(1000 + i);
        }
        for c in sched.take() {
            c.drain();
        }
        assert!(ran.lock().unwrap().is_empty(), "the listener was busy");
        assert!(sched.take().is_empty(), "parked slots hold no thread");
        (sched, listener, children, held, ran)
    }

    /// When the listener's callback ends, one parked child is scheduled, not all of them
    /// (each would only find the listener busy again with the first one's event: a burst
    /// of n connect requests cost n² schedules); each entered child's end schedules the
    /// next, in the order they came, so n children cost n schedules.
    #[test]
    fn a_gates_callback_end_schedules_one_parked_slot_and_each_end_the_next() {
        let (sched, _listener, _children, held, ran) = parked_children(50);
        drop(held);
        let mut schedules = 0;
        loop {
            let ready = sched.take();
            if ready.is_empty() {
                break;
            }
            assert_eq!(ready.len(), 1, "one at a time");
            schedules += 1;
            ready[0].drain();
        }
        assert_eq!(schedules, 50);
        assert_eq!(*ran.lock().unwrap(), (1000..1050).collect::<Vec<u32>>());
    }

    /// A parked request whose turn finds the listener busy again (a newcomer, or an event of
    /// its own, went in first) goes back to the front, and the next turn is its: the
    /// requests that parked go in in the order they came, however often the listener is
    /// busy when a turn comes. (It went to the back, behind all that parked meanwhile.)
    #[test]
    fn a_turn_that_finds_the_gate_busy_keeps_its_place() {
        let (sched, listener, _children, held, ran) = parked_children(3);
        drop(held);
        let turn = sched.take();
        assert_eq!(turn.len(), 1, "the turn went to the first");
        // A newcomer goes in meanwhile and is still running when the turn comes.
        listener.inner.lock().unwrap().running = Some(std::thread::current().id());
        // Its end is a callback's end, as a guard's drop is.
        let newcomer = super::EnterGuard(listener.clone());
        turn[0].drain();
        assert!(ran.lock().unwrap().is_empty(), "went in on a busy listener");
        // Another parks while the listener is busy: behind the three.
        let r = ran.clone();
        let record: super::Callback<u32> = Arc::new(move |_, ev| {
            r.lock().unwrap().push(ev);
            Flow::Continue
        });
        let late = Slot::new(Target::Callback(record), sched.clone());
        late.push(1099);
        for s in sched.take() {
            s.drain();
        }
        drop(newcomer);
        loop {
            let ready = sched.take();
            if ready.is_empty() {
                break;
            }
            assert_eq!(ready.len(), 1, "one at a time");
            ready[0].drain();
        }
        assert_eq!(*ran.lock().unwrap(), vec![1000, 1001, 1002, 1099]);
    }

    /// A child scheduled by a hand-off that is destroyed, or whose event a device removal
    /// replaces, before it goes in passes the turn on: the rest are not left parked on an
    /// idle listener.
    #[test]
    fn a_handed_off_slot_that_will_not_come_passes_the_turn_on() {
        let (sched, _listener, children, held, ran) = parked_children(3);
        drop(held);
        let first = sched.take();
        assert_eq!(first.len(), 1);
        assert!(Arc::ptr_eq(&first[0], &children[0]));
        assert!(children[0].destroy(false).is_ok());
        let second = sched.take();
        assert_eq!(second.len(), 1, "the turn went on at the destroy");
        assert!(Arc::ptr_eq(&second[0], &children[1]));
        assert!(children[1].push_removal(7));
        let third = sched.take();
        assert!(
            third.iter().any(|s| Arc::ptr_eq(s, &children[2])),
            "the turn went on at the removal"
        );
        for s in third.into_iter().chain(first).chain(second) {
            s.drain();
        }
        for s in sched.take() {
            s.drain();
        }
        // The removal ran on the second child; the third went in.
        let mut got = ran.lock().unwrap().clone();
        got.sort_unstable();
        assert_eq!(got, vec![7, 1002]);
        assert_eq!(*sched.discarded.lock().unwrap(), vec![1000, 1001]);
    }

    /// Destroying the listener while children are parked on it schedules every one: each
    /// finds it closed, its event is discarded undelivered and the child destroyed.
    #[test]
    fn a_closed_gate_releases_every_parked_slot() {
        let (sched, listener, children, held, ran) = parked_children(4);
        assert!(listener.destroy(false).is_ok());
        drop(held);
        let ready = sched.take();
        assert_eq!(ready.len(), 4);
        for s in ready {
            s.drain();
        }
        assert!(ran.lock().unwrap().is_empty());
        assert_eq!(
            sched.discarded.lock().unwrap().len(),
            0,
            "dropped where found closed"
        );
        for c in &children {
            assert_ne!(c.phase(), super::Phase::Live);
        }
    }

    /// A parked child that something else schedules (another event for it) while the
    /// listener is still busy parks again without a second entry, and goes in once.
    #[test]
    fn a_slot_parked_twice_is_listed_once() {
        let (sched, listener, children, held, ran) = parked_children(1);
        children[0].push(5);
        let again = sched.take();
        assert_eq!(again.len(), 1);
        again[0].drain();
        let listed = listener
            .inner
            .lock()
            .unwrap()
            .extra
            .as_ref()
            .map_or(0, |e| e.parked.len());
        assert_eq!(listed, 1);
        drop(held);
        for s in sched.take() {
            s.drain();
        }
        assert!(sched.take().is_empty());
        assert_eq!(*ran.lock().unwrap(), vec![1000, 5]);
    }
}
