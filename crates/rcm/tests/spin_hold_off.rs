//! A poller beside a CPU-bound process stops polling (see `rcm::spin_until`): its own
//! binary, so that no other test's polling threads share the CPU and count as this
//! process's looks. Its cases that must not hold off need a moment when no other process
//! keeps a CPU busy (see `ATTEMPTS`; each CPU the test may use is tried in turn, and the
//! rest of the test runs on the one found quiet): beside a build running on every CPU they
//! fail, as a poller there should stop polling.

#![cfg(target_os = "linux")]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The tests share their CPU's count of looks: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Rounds over the allowed CPUs of a case that should not be held off, of which one run
/// must not be: another process busy on a CPU meanwhile (a build, a test's busy loop)
/// holds a poller there off as it should. A rule that is wrong holds it off every time (the
/// end-of-batch count this file's second test was written for: 15 of 15 runs).
const ATTEMPTS: usize = 3;

/// Runs `quiet` on each CPU this test may use in turn, for up to [`ATTEMPTS`] rounds; the
/// first CPU where it held (none if it never did).
fn quiet_cpu(mut quiet: impl FnMut(usize) -> bool) -> Option<usize> {
    let set = rustix::thread::sched_getaffinity(None).expect("affinity");
    let cpus: Vec<usize> = (0..rustix::thread::CpuSet::MAX_CPU)
        .filter(|&c| set.is_set(c))
        .collect();
    assert!(!cpus.is_empty(), "a CPU this test may run on");
    (0..ATTEMPTS)
        .flat_map(|_| cpus.iter().copied())
        .find(|&cpu| quiet(cpu))
}

fn pin(cpu: usize) {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set).expect("pin");
}

/// Kills the CPU-bound process however the test ends.
struct Hog(std::process::Child);

impl Drop for Hog {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_poll_beside_a_cpu_bound_process_ends_within_a_few_ticks_and_holds_off() {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // Undisturbed, a poll lasts its time and leaves polling allowed (see `ATTEMPTS`; each
    // attempt on a thread of its own: a hold-off is the thread's).
    let cpu = quiet_cpu(|cpu| {
        std::thread::spawn(move || {
            pin(cpu);
            !rcm::spin_until(Duration::from_millis(20), || false) && rcm::spin_allowed()
        })
        .join()
        .expect("poller")
    })
    .expect("held off without a CPU-bound neighbour, on every CPU");
    pin(cpu);
    // A shell loop on the same CPU: it never yields back.
    let hog = std::process::Command::new("sh")
        .args(["-c", "while :; do :; done"])
        .spawn()
        .expect("sh");
    let hog = Hog(hog);
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(rustix::process::Pid::from_child(&hog.0).into(), &set)
        .expect("pin the loop");
    std::thread::sleep(Duration::from_millis(50));
    let start = Instant::now();
    let got = rcm::spin_until(Duration::from_secs(20), || false);
    let took = start.elapsed();
    let held = !rcm::spin_allowed();
    // While held off, a poll is one look.
    let mut looks = 0;
    rcm::spin_until(Duration::from_secs(20), || {
        looks += 1;
        false
    });
    drop(hog);
    assert!(!got);
    // Ended at its second stolen yield (a few ticks), not after its 20 s.
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert!(
        held,
        "polling still allowed after a yield to a CPU-bound process"
    );
    assert!(
        looks == 1 || rcm::spin_allowed(),
        "{looks} looks while held off"
    );
}

/// A thread of this process on the poller's CPU that works in batches longer than
/// `rcm::STOLEN_YIELD` between yields: a device thread handling a burst, a datagram at a
/// time.
struct Sibling {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<u32>>,
}

impl Sibling {
    /// `counts`: whether it counts a look (`rcm::look_here`) after each 20 µs of its
    /// batches, as rcm's device threads do at each datagram.
    fn start(cpu: usize, batch: Duration, counts: bool) -> Sibling {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            pin(cpu);
            let mut batches = 0;
            while !flag.load(Ordering::Relaxed) {
                let start = Instant::now();
                while start.elapsed() < batch {
                    let unit = Instant::now();
                    while unit.elapsed() < Duration::from_micros(20) {
                        std::hint::spin_loop();
                    }
                    if counts {
                        rcm::look_here();
                    }
                }
                batches += 1;
                std::thread::yield_now();
            }
            batches
        });
        Sibling {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops it; how many batches it did.
    fn stop(mut self) -> u32 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().map_or(0, |t| t.join().unwrap_or(0))
    }
}

impl Drop for Sibling {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Polls for `spin` on `cpu` beside a sibling; how long the poll lasted, whether polling
/// is still allowed afterwards, and the sibling's batches. Each run is a fresh thread (the
/// hold-off is per thread).
fn poll_beside(cpu: usize, counts: bool, spin: Duration) -> (Duration, bool, u32) {
    std::thread::spawn(move || {
        pin(cpu);
        let sibling = Sibling::start(cpu, Duration::from_millis(3), counts);
        std::thread::sleep(Duration::from_millis(20));
        let start = Instant::now();
        let got = rcm::spin_until(spin, || false);
        let took = start.elapsed();
        let allowed = rcm::spin_allowed();
        let batches = sibling.stop();
        assert!(!got);
        (took, allowed, batches)
    })
    .join()
    .expect("poller")
}

/// The yields a poller spends beside a sibling's 3 ms batches are not stolen when the
/// sibling counts its looks as it works: the poll lasts its time and polling stays
/// allowed, whether the sibling yields at the end of a batch or the scheduler preempts it
/// in the middle of one. The same sibling without `look_here` holds the poller off (the
/// rule's other side, which shows the test can fail).
#[test]
fn a_siblings_long_batches_are_not_stolen_yields_when_it_counts_its_looks() {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let spin = Duration::from_millis(300);
    let mut runs = Vec::new();
    let cpu = quiet_cpu(|cpu| {
        let (took, allowed, batches) = poll_beside(cpu, true, spin);
        assert!(batches >= 3, "the sibling ran {batches} batches");
        runs.push((cpu, took, allowed));
        took >= spin && allowed
    });
    let Some(cpu) = cpu else {
        panic!(
            "beside a counting sibling, polls ended after (CPU, time, polling allowed): {runs:?}"
        );
    };
    let (took, allowed, batches) = poll_beside(cpu, false, spin);
    assert!(batches >= 1, "the sibling ran {batches} batches");
    assert!(
        took < spin && !allowed,
        "beside a sibling that does not count: poll ended after {took:?}, polling allowed: {allowed}"
    );
}
