//! The crate's one lock helper: a poisoned mutex is taken as it is.
//!
//! Decision: every critical section in this crate is a handful of field, map or vector updates
//! (buffer free lists, the endpoint's registry, link tables, sealers' key schedules), so a panic
//! while one is held cannot leave its data half-updated, and a later user takes the lock rather
//! than failing too. A section that could leave its data inconsistent must not use this helper.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, taking it as it is if a panic poisoned it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Locks `m` if nobody holds it now (poisoned or not, as [`lock`]); `None` if somebody does.
#[cfg(any(feature = "quic", feature = "shm"))]
pub(crate) fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(guard) => Some(guard),
        Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}
