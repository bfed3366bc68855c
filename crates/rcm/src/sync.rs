//! The synchronisation primitives the concurrency core uses: std's, or loom's when the crate
//! is built with `--cfg loom` so the core can be model-checked.

// `Arc` stays std's under loom: the core needs `self: &Arc<Self>` receivers and `Arc<dyn ..>`
// coercions, which loom's `Arc` cannot provide on stable. Reference counting is not what the
// models check; the locks and condition variables, which are, are loom's.
#[cfg(loom)]
pub(crate) use loom::sync::{Condvar, Mutex, MutexGuard};
#[cfg(loom)]
pub(crate) use loom::thread;
#[cfg(loom)]
pub(crate) use std::sync::Arc;

#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Condvar, Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::thread;

/// Locks, recovering from poisoning: a panicking user callback is caught before it can poison
/// a core lock, and the core's own critical sections do not panic, so the data is consistent.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    #[cfg(loom)]
    {
        m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
    #[cfg(not(loom))]
    {
        m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Waits on a condition variable, recovering from poisoning likewise.
pub(crate) fn wait<'a, T>(c: &Condvar, g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    #[cfg(loom)]
    {
        c.wait(g).unwrap_or_else(std::sync::PoisonError::into_inner)
    }
    #[cfg(not(loom))]
    {
        c.wait(g).unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Waits with a timeout (std only; loom has no time).
#[cfg(not(loom))]
pub(crate) fn wait_timeout<'a, T>(
    c: &Condvar,
    g: MutexGuard<'a, T>,
    d: std::time::Duration,
) -> MutexGuard<'a, T> {
    c.wait_timeout(g, d)
        .map_or_else(|e| e.into_inner().0, |(g, _)| g)
}
