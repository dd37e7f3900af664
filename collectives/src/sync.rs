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
