//! Runs N connection cycles on one thread (connect to destroy, both ends on one looped
//! device: `benches/processing/cycle.rs`) and prints the time per cycle. Made for counting
//! instructions, which unlike times do not drift with the machine:
//!
//! ```text
//! cargo build --release -p rcm --example cycles
//! valgrind --tool=callgrind --toggle-collect='cycles::cycle::cycle' \
//!     target/release/examples/cycles 3000
//! ```
//!
//! divides the collected count by N + 200 (the warm-up cycles count too).

#[path = "../benches/processing/cycle.rs"]
mod cycle;

use std::time::Instant;

fn main() {
    let n: usize = match std::env::args().nth(1).map(|a| a.parse()) {
        None => 5000,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            eprintln!("usage: cycles [N]   (N connection cycles, default 5000)");
            std::process::exit(2);
        }
    };
    let bed = cycle::Bed::new(47961);
    for _ in 0..200 {
        cycle::cycle(&bed);
    }
    let t = Instant::now();
    for _ in 0..n {
        cycle::cycle(&bed);
    }
    let el = t.elapsed();
    println!(
        "{n} cycles: {:.2} us/cycle",
        el.as_secs_f64() * 1e6 / n.max(1) as f64
    );
    bed.shutdown();
}
