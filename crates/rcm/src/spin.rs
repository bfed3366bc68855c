//! Polling before sleeping, and when not to.
//!
//! rcm's threads poll a while (`FabricConfig::spin`) before they sleep, yielding the CPU
//! between looks: waking a sleeping thread costs tens of µs on a VM, more than the work.
//! The yield is what lets the other pollers on the same CPU (a device's thread, a waiter,
//! a daemon session's reader) run: they yield back within microseconds, or after a batch
//! of work.
//!
//! A thread of another process that does not poll does not yield back. On a CPU shared
//! with a CPU-bound process, `sched_yield` hands that process the CPU until the next
//! scheduler tick (4 ms here), and a poller yields again at its next look: every hop of a
//! connect then waited a tick. Measured on the 2-CPU VMs with `sh -c 'while :; do :;
//! done'` on each CPU: a serial connect's p50 was 3.9 ms (41 µs with polling off); through
//! a daemon pinned to a CPU beside one such loop, 8 ms, and a burst 131 connections a
//! second. A sleeping thread does not lose its turn that way: its wake-up preempts the
//! CPU-bound one.
//!
//! So a yield that kept the CPU away for longer than [`STOLEN_YIELD`] while no thread of
//! this process ran on that CPU is stolen, and the third within [`CONFIRM_WITHIN`] of the
//! first ends the poll: the thread then sleeps instead of polling for a while,
//! [`HOLD_OFF`], doubled at each hold-off that follows within [`FORGET_AFTER`] of the end
//! of the one before, up to [`MAX_HOLD_OFF`]. A CPU-bound neighbour that stays thus costs
//! a poller three ticks per [`MAX_HOLD_OFF`] once it has been there a few seconds. Fewer
//! stolen yields are not enough: an idle 2-CPU VM has them too (the kernel's own threads,
//! the hypervisor running another guest: 12–16 in a 3,000-connection serial run, 1.0–1.8
//! ms each), and holding off at the second of two made that run's connections a third
//! slower. Per thread: threads on other CPUs may be alone on theirs.
//!
//! Who ran is told by a per-CPU count that this process's polling threads advance at each
//! look; the length alone does not tell: a daemon's device thread handling a batch of
//! requests holds its CPU for milliseconds too (a burst through a daemon pinned to one
//! CPU: ~500 yields over 250 µs, most of them in runs), and holding its pollers off for
//! that halved the burst's rate. The workers count as they go (see [`look_here`]): a
//! scheduler that preempts a batch in its middle (EEVDF slices are a few ms at most)
//! hands the poller's yield back before the batch's end, and with a count taken only at
//! the end a poller beside 3 ms batches was held off within 15–33 ms in each of 15 runs of
//! a test.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A yield that took longer than this, with no look of this process's pollers on the CPU
/// meanwhile, was stolen. A CPU-bound process holds the CPU until the next scheduler
/// tick (1–4 ms; with one on each CPU, 98 % of the yields that came back late came back
/// after 1 ms or more); a thread of this process that does not poll (the application's
/// own, a test's) may run a few hundred µs, and yielding to it for that long is fine.
pub const STOLEN_YIELD: Duration = Duration::from_millis(1);

/// How long a thread sleeps instead of polling when its stolen yields hold it off and its
/// last hold-off ended longer than [`FORGET_AFTER`] ago.
pub const HOLD_OFF: Duration = Duration::from_millis(2);

/// The longest hold-off, reached by doubling while hold-offs keep coming.
pub const MAX_HOLD_OFF: Duration = Duration::from_millis(1600);

/// A hold-off this long after the end of the one before starts again from [`HOLD_OFF`].
pub const FORGET_AFTER: Duration = Duration::from_secs(1);

/// Stolen yields within [`CONFIRM_WITHIN`] that hold a thread off.
pub const CONFIRM_STEALS: u32 = 3;

/// See [`CONFIRM_STEALS`].
pub const CONFIRM_WITHIN: Duration = Duration::from_millis(50);

/// A thread's hold-off: until when it does not poll, how long its last one was and when
/// it began, and the stolen yields since (the first of them, and how many).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Held {
    until: Option<Instant>,
    len: Duration,
    last: Option<Instant>,
    suspect: Option<(Instant, u32)>,
}

impl Held {
    const NONE: Held = Held {
        until: None,
        len: Duration::ZERO,
        last: None,
        suspect: None,
    };

    /// After a yield stolen at `now`.
    fn stolen(self, now: Instant) -> Held {
        let (first, n) = match self.suspect {
            Some((first, n)) if now.saturating_duration_since(first) < CONFIRM_WITHIN => {
                (first, n + 1)
            }
            _ => (now, 1),
        };
        if n < CONFIRM_STEALS {
            return Held {
                suspect: Some((first, n)),
                ..self
            };
        }
        let len = match self.last {
            Some(t) if now.saturating_duration_since(t + self.len) < FORGET_AFTER => {
                (self.len * 2).min(MAX_HOLD_OFF)
            }
            _ => HOLD_OFF,
        };
        Held {
            until: Some(now + len),
            len,
            last: Some(now),
            suspect: None,
        }
    }
}

std::thread_local! {
    /// This thread's hold-off.
    static HELD_OFF: Cell<Held> = const { Cell::new(Held::NONE) };
    /// How many hold-offs this thread has begun (see [`hold_offs`]).
    static HOLD_OFFS: Cell<u64> = const { Cell::new(0) };
    /// The CPU this thread last found itself on (`usize::MAX`: not asked yet). Asked again
    /// only after a long yield: a thread that moved meanwhile counts its looks on its old
    /// CPU's count until then, which can only make a stolen yield look fair once.
    static CPU: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// One CPU's count of looks by this process's polling threads, on a cache line of its
/// own (each is written by the threads on its CPU).
#[repr(align(128))]
struct Looks(AtomicU64);

/// CPUs past this share counts (a shared count can only make a stolen yield look fair).
const CPUS: usize = 64;

static LOOKS: [Looks; CPUS] = [const { Looks(AtomicU64::new(0)) }; CPUS];

fn this_cpu() -> usize {
    crate::sys::current_cpu() % CPUS
}

/// The count of the CPU this thread runs on (as far as it knows), and the CPU.
fn my_looks() -> (usize, &'static AtomicU64) {
    let cpu = CPU
        .try_with(|c| {
            if c.get() == usize::MAX {
                c.set(this_cpu());
            }
            c.get()
        })
        .unwrap_or(0)
        % CPUS;
    (cpu, &LOOKS[cpu].0)
}

/// Counts a look of this thread on its CPU: a poller that yielded to it sees that one of
/// its own process ran there (see the module documentation). rcm's polling loops count at
/// each look and before each yield or sleep, its device threads at each datagram and its
/// dispatcher at each id's callbacks. A loop of another crate that works between its polls
/// for longer than `STOLEN_YIELD` (1 ms) without passing through [`spin_until`] or
/// [`yield_to_pollers`] (a daemon's ring thread serving its clients) calls this at each
/// piece of work, or the pollers beside it take its work for a stolen yield. At each
/// piece, not only between batches: the scheduler may hand the CPU to a poller in the
/// middle of a batch and back, and the poller's yield then ends with the batch's next
/// piece, not its end.
pub fn look_here() {
    count_look(my_looks().1);
}

/// Advances a CPU's count; what it now holds. Not a read-modify-write (a locked
/// instruction at every look): the threads counting on one CPU run one at a time, and one
/// preempted between its load and its store still leaves the count changed.
fn count_look(looks: &AtomicU64) -> u64 {
    let n = looks.load(Ordering::Relaxed).wrapping_add(1);
    looks.store(n, Ordering::Relaxed);
    n
}

/// How many times the calling thread has been held off polling (a neighbour that does not
/// yield back was confirmed, see the module documentation) since it began. What a caller
/// that expected this thread to poll compares before and after: a wait whose count moved
/// slept instead, by design (a test's premise that did not hold, a benchmark's run that
/// had a CPU-bound neighbour).
pub fn hold_offs() -> u64 {
    HOLD_OFFS.try_with(Cell::get).unwrap_or(0)
}

/// How many hold-offs this process's threads have begun, all of them (see [`hold_offs`]):
/// what a benchmark reports beside its numbers, which then include sleeps where polls were
/// meant.
pub fn process_hold_offs() -> u64 {
    PROCESS_HOLD_OFFS.load(Ordering::Relaxed)
}

static PROCESS_HOLD_OFFS: AtomicU64 = AtomicU64::new(0);

/// Whether this thread may poll now (it is not held off after a stolen yield). Reads no
/// clock unless a hold-off was set.
pub fn spin_allowed() -> bool {
    HELD_OFF
        .try_with(|h| {
            let held = h.get();
            match held.until {
                None => true,
                Some(t) if Instant::now() >= t => {
                    h.set(Held {
                        until: None,
                        ..held
                    });
                    true
                }
                Some(_) => false,
            }
        })
        .unwrap_or(true)
}

/// `spin`, or zero while this thread is held off: how long a poll that is about to begin
/// (and may ask others to stand aside meanwhile) should last.
pub fn spin_budget(spin: Duration) -> Duration {
    if spin.is_zero() || spin_allowed() {
        spin
    } else {
        Duration::ZERO
    }
}

/// Yields the CPU to the other pollers; false when the yield was stolen and confirmed a
/// neighbour that does not yield back (see the module documentation): this thread is then
/// held off polling, and the caller should sleep.
pub fn yield_to_pollers() -> bool {
    yield_since(Instant::now(), begin_look()).0
}

/// A look of this thread begins: counted on its CPU; the CPU, its count and the count now.
fn begin_look() -> (usize, &'static AtomicU64, u64) {
    let (cpu, looks) = my_looks();
    (cpu, looks, count_look(looks))
}

/// [`yield_to_pollers`] for a caller that read the clock at `before` and began its look
/// (`look`, from [`begin_look`]) then; also returns the time the yield came back. The time
/// from `before` counts as the yield's unless a look of this process on this CPU came
/// after the look began: the look's own work (a waiter handling a batch of datagrams,
/// each counted) is this process's, not stolen.
fn yield_since(before: Instant, look: (usize, &'static AtomicU64, u64)) -> (bool, Instant) {
    let (cpu, looks, seen) = look;
    std::thread::yield_now();
    let after = Instant::now();
    if after.saturating_duration_since(before) <= STOLEN_YIELD {
        return (true, after);
    }
    // Long: stolen only if no poller of this process looked on this CPU meanwhile (and
    // this thread is still on it; a move is taken as fair, and remembered).
    let now_on = this_cpu();
    let _ = CPU.try_with(|c| c.set(now_on));
    if now_on != cpu || looks.load(Ordering::Relaxed) != seen {
        return (true, after);
    }
    (stolen_at(after), after)
}

/// Takes note of a yield of this thread stolen at `now`; false when that held it off.
fn stolen_at(now: Instant) -> bool {
    HELD_OFF
        .try_with(|h| {
            let held = h.get().stolen(now);
            h.set(held);
            if held.until.is_some() {
                let _ = HOLD_OFFS.try_with(|n| n.set(n.get() + 1));
                PROCESS_HOLD_OFFS.fetch_add(1, Ordering::Relaxed);
            }
            held.until.is_none()
        })
        .unwrap_or(true)
}

/// Polls `ready` (yielding the CPU between looks) until it is true or `spin` has passed;
/// whether it became true. The one polling loop of rcm's threads (and rcm-ucm's readers).
/// While this thread is held off (a yield of an earlier poll was stolen, see the module
/// documentation) it looks once; a yield stolen here ends the poll with one last look.
pub fn spin_until(spin: Duration, mut ready: impl FnMut() -> bool) -> bool {
    // A thread that comes here from work (a batch handled while a poller on its CPU
    // yielded to it) shows it was this process's before that poller looks again.
    look_here();
    if spin.is_zero() || !spin_allowed() {
        return ready();
    }
    // One reading of the clock a look: the one after its yield (the poll's end is a
    // bound, not a promise). A look's long work shows as looks counted in it.
    let mut now = Instant::now();
    let end = rcm_proto::later(now, spin);
    loop {
        let look = begin_look();
        if ready() {
            return true;
        }
        if now >= end {
            return false;
        }
        let (fair, after) = yield_since(now, look);
        if !fair {
            return ready();
        }
        now = after;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clear() {
        HELD_OFF.with(|h| h.set(Held::NONE));
    }

    fn hold_off_for(d: Duration) {
        let now = Instant::now();
        HELD_OFF.with(|h| {
            h.set(Held {
                until: Some(now + d),
                len: d,
                last: Some(now),
                suspect: None,
            });
        });
    }

    /// A look whose own work is long (a waiter handling a batch of datagrams, each
    /// counted with `look_here`) is not a stolen yield: it was taken for one (the clock
    /// ran from before the work), and three such looks held the thread off polling just
    /// when it had work.
    #[test]
    fn a_looks_own_counted_work_is_not_a_stolen_yield() {
        clear();
        let before = hold_offs();
        let mut looks = 0;
        spin_until(Duration::from_millis(100), || {
            looks += 1;
            let end = Instant::now() + 2 * STOLEN_YIELD;
            while Instant::now() < end {
                look_here();
                std::hint::spin_loop();
            }
            false
        });
        assert!(looks >= 4, "{looks} looks");
        assert_eq!(hold_offs(), before, "held off by its own work");
        assert!(spin_allowed());
    }

    #[test]
    fn a_held_off_thread_looks_once_and_does_not_poll() {
        clear();
        hold_off_for(Duration::from_secs(60));
        assert!(!spin_allowed());
        assert_eq!(spin_budget(Duration::from_micros(100)), Duration::ZERO);
        let mut looks = 0;
        let start = Instant::now();
        assert!(!spin_until(Duration::from_millis(200), || {
            looks += 1;
            false
        }));
        assert_eq!(looks, 1);
        assert!(start.elapsed() < Duration::from_millis(200));
        // Other threads are not held off by this one's.
        std::thread::spawn(|| assert!(spin_allowed()))
            .join()
            .expect("other thread");
        clear();
    }

    #[test]
    fn the_thread_counts_its_hold_offs_not_its_stolen_yields() {
        clear();
        let before = hold_offs();
        let t = Instant::now();
        let ms = Duration::from_millis;
        assert!(stolen_at(t));
        assert!(stolen_at(t + ms(1)));
        assert_eq!(hold_offs(), before, "two stolen yields do not hold off");
        assert!(!stolen_at(t + ms(2)));
        assert_eq!(hold_offs(), before + 1);
        assert!(process_hold_offs() > 0);
        assert!(!spin_allowed());
        // Another thread's count is its own.
        std::thread::spawn(|| assert_eq!(hold_offs(), 0))
            .join()
            .expect("other thread");
        clear();
    }

    #[test]
    fn a_hold_off_ends_by_itself() {
        clear();
        hold_off_for(Duration::from_millis(20));
        assert!(!spin_allowed());
        std::thread::sleep(Duration::from_millis(30));
        assert!(spin_allowed());
        assert_eq!(
            spin_budget(Duration::from_micros(100)),
            Duration::from_micros(100)
        );
        clear();
    }

    /// Beside a CPU-bound process the poll is disturbed by design (held off, it looks once
    /// more and ends): each attempt runs on a fresh thread, and one that was held off (its
    /// count of hold-offs moved) is tried again, up to five times.
    #[test]
    fn an_undisturbed_poll_polls_until_ready_or_its_time() {
        for n in 1..=5 {
            let undisturbed = std::thread::spawn(|| {
                let mut looks = 0;
                let ready = spin_until(Duration::from_secs(5), || {
                    looks += 1;
                    looks == 50
                });
                let start = Instant::now();
                let timed_out = !spin_until(Duration::from_millis(20), || false);
                let took = start.elapsed();
                if hold_offs() > 0 {
                    return false;
                }
                assert!(ready);
                assert_eq!(looks, 50);
                assert!(timed_out);
                assert!(took >= Duration::from_millis(20));
                assert!(spin_allowed());
                true
            })
            .join()
            .expect("poller");
            if undisturbed {
                return;
            }
            eprintln!("attempt {n}: held off polling (a CPU-bound neighbour)");
        }
        eprintln!("skipped: every attempt was held off polling; this host is too busy to test it");
    }

    #[test]
    fn the_third_stolen_yield_soon_after_the_first_holds_off_and_hold_offs_double_then_start_over()
    {
        let ms = Duration::from_millis;
        let t = Instant::now();
        // Two do not.
        let two = Held::NONE.stolen(t).stolen(t + ms(4));
        assert_eq!((two.until, two.suspect), (None, Some((t, 2))));
        // Nor a third past the window of the first: it begins another.
        let late = two.stolen(t + CONFIRM_WITHIN);
        assert_eq!(
            (late.until, late.suspect),
            (None, Some((t + CONFIRM_WITHIN, 1)))
        );
        let at = t + CONFIRM_WITHIN + ms(8);
        let a = late.stolen(t + CONFIRM_WITHIN + ms(4)).stolen(at);
        assert_eq!(
            (a.until, a.len, a.suspect),
            (Some(at + HOLD_OFF), HOLD_OFF, None)
        );
        let three = |h: Held, now: Instant| h.stolen(now).stolen(now + ms(4)).stolen(now + ms(8));
        // The next three, after that hold-off, hold off twice as long.
        let b = three(a, at + HOLD_OFF);
        assert_eq!(b.len, HOLD_OFF * 2);
        let mut h = b;
        let mut now = at + HOLD_OFF;
        for _ in 0..20 {
            now += h.len + ms(8);
            h = three(h, now);
        }
        assert_eq!(h.len, MAX_HOLD_OFF);
        let quiet = h.last.expect("held off") + h.len + FORGET_AFTER;
        assert_eq!(three(h, quiet).len, HOLD_OFF);
    }
}
