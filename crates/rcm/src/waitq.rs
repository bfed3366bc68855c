//! A queue that readers may wait on, whose writers wake them only when some wait.
//!
//! std's `Condvar::notify_all` is a `futex` system call whether or not a thread waits, and
//! an id's message queues are written far more often than waited on: every teardown of an
//! id that has them woke both (two system calls per id through the daemon, 166 ns each at
//! the least on a host with the SRSO mitigation), and every message or UD datagram woke
//! its queue's condition variable though the reader was polling with `try_recv_*`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// A FIFO behind a lock, with a condition variable for its readers.
pub(crate) struct WaitQueue<T> {
    q: Mutex<VecDeque<T>>,
    cv: Condvar,
    /// Threads in [`WaitQueue::wait_timeout`]. Changed and read only under `q`'s lock, so a
    /// writer that finds zero there knows no reader can be between its last look at the
    /// queue and its sleep (it would have counted itself before releasing the lock).
    waiting: AtomicU32,
}

impl<T> Default for WaitQueue<T> {
    fn default() -> Self {
        WaitQueue {
            q: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
            waiting: AtomicU32::new(0),
        }
    }
}

impl<T> WaitQueue<T> {
    /// The queue, locked (recovering from poisoning, as `sync::lock`).
    pub(crate) fn lock(&self) -> MutexGuard<'_, VecDeque<T>> {
        crate::sync::lock(&self.q)
    }

    /// Releases `g` and sleeps until a [`WaitQueue::wake`] or `d` passes (or spuriously),
    /// then takes the lock again.
    pub(crate) fn wait_timeout<'a>(
        &'a self,
        g: MutexGuard<'a, VecDeque<T>>,
        d: Duration,
    ) -> MutexGuard<'a, VecDeque<T>> {
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let g = self
            .cv
            .wait_timeout(g, d)
            .map_or_else(|e| e.into_inner().0, |(g, _)| g);
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        g
    }

    /// Releases `g` (the caller changed the queue under it) and wakes the readers waiting,
    /// if there are any.
    pub(crate) fn wake(&self, g: MutexGuard<'_, VecDeque<T>>) {
        let any = self.waiting.load(Ordering::Relaxed) > 0;
        drop(g);
        if any {
            self.cv.notify_all();
        }
    }

    #[cfg(test)]
    fn waiting(&self) -> u32 {
        let _g = self.lock();
        self.waiting.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn a_waiting_reader_is_woken_and_counted() {
        let wq = Arc::new(WaitQueue::<u32>::default());
        assert_eq!(wq.waiting(), 0);
        let r = {
            let wq = wq.clone();
            std::thread::spawn(move || {
                let start = Instant::now();
                let mut g = wq.lock();
                while g.is_empty() {
                    g = wq.wait_timeout(g, Duration::from_secs(60));
                }
                (g.pop_front(), start.elapsed())
            })
        };
        let start = Instant::now();
        while wq.waiting() == 0 {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the reader never waited"
            );
            std::thread::yield_now();
        }
        let mut g = wq.lock();
        g.push_back(7);
        wq.wake(g);
        let (got, took) = r.join().expect("reader");
        assert_eq!(got, Some(7));
        // Woken by `wake`, not by its 60 s timeout.
        assert!(took < Duration::from_secs(30), "{took:?}");
        assert_eq!(wq.waiting(), 0);
    }

    #[test]
    fn a_wake_with_no_reader_leaves_the_queue_as_written() {
        let wq = WaitQueue::<u32>::default();
        let mut g = wq.lock();
        g.push_back(1);
        g.push_back(2);
        wq.wake(g);
        assert_eq!(wq.waiting(), 0);
        let g = wq.wait_timeout(wq.lock(), Duration::from_millis(1));
        assert_eq!(g.iter().copied().collect::<Vec<_>>(), [1, 2]);
    }
}
