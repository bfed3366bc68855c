//! A poller beside a CPU-bound process stops polling (see `rcm::spin_until`): its own
//! binary, so that no other test's polling threads share the CPU and count as this
//! process's looks.

#![cfg(target_os = "linux")]

use std::time::{Duration, Instant};

fn one_allowed_cpu() -> Option<usize> {
    let set = rustix::thread::sched_getaffinity(None).ok()?;
    (0..rustix::thread::CpuSet::MAX_CPU).find(|&c| set.is_set(c))
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
    let cpu = one_allowed_cpu().expect("a CPU this test may run on");
    pin(cpu);
    // Undisturbed, a poll lasts its time and leaves polling allowed.
    assert!(!rcm::spin_until(Duration::from_millis(20), || false));
    assert!(rcm::spin_allowed());
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
