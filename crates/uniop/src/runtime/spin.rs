//! Spin-then-park, shared by every waiter in the runtime.
//!
//! Waking a parked thread costs tens of microseconds here, while back-to-back launches arrive
//! within a microsecond; so waiters first spin for a short budget, then park on their condvar.
//! The budget is short because the machines have 2 cores: a long spin steals a core from the
//! thread doing the work.

use std::time::{Duration, Instant};

/// How long a waiter spins before parking.
pub(crate) const SPIN: Duration = Duration::from_micros(50);

/// Spins until `ready()` holds or the budget is spent; returns whether it became ready.
#[inline]
pub(crate) fn spin_until(mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if ready() {
            return true;
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(64) && start.elapsed() >= SPIN {
            return false;
        }
        std::hint::spin_loop();
    }
}
