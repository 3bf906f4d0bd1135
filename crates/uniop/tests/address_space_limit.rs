//! The caching allocator when the OS refuses memory, in its own test binary: the test caps the
//! process's address space (`RLIMIT_AS`, what `ulimit -v` sets).
//!
//! Under the cap, the OS refuses a mapping for real — the same `ENOMEM` a cgroup-limited or
//! strict-overcommit machine gives — with no physical memory used: the blocks are never written.

mod common;

use uniop::runtime::{Allocator, MemPolicy};
use uniop::ErrorCode;

const MIB: usize = 1 << 20;

#[test]
fn a_refused_block_is_retried_after_emptying_the_cache_and_else_reported() {
    let alloc = Allocator::global();
    // 600 MiB of cached blocks plus a 700 MiB request do not fit under a 1 GiB cap; either alone does.
    common::cap_address_space(1024 * MIB);

    drop(alloc.allocate(600 * MIB, MemPolicy::HugeFirst).expect("600 MiB under the cap"));
    let cached = alloc.stats();
    assert_eq!((cached.allocated, cached.reserved), (0, 600 * MIB), "the freed block stays cached");

    let big = alloc.allocate(700 * MIB, MemPolicy::HugeFirst).expect("the cache gave its 600 MiB back");
    let s = alloc.stats();
    assert_eq!((s.alloc_retries, s.ooms), (1, 0));
    assert_eq!((s.allocated, s.reserved), (700 * MIB, 700 * MIB), "the cached block went back to the OS");

    // With the 700 MiB live, a second one fails even with nothing cached: a clear error, the
    // counters unchanged but for the refusal.
    let err = alloc.allocate(700 * MIB, MemPolicy::HugeFirst).unwrap_err();
    assert_eq!(err.code(), ErrorCode::Runtime);
    let msg = err.message();
    assert!(msg.contains(&format!("allocating {} bytes failed", 700 * MIB)), "{msg}");
    assert!(msg.contains("returning 0.00 MiB of cached blocks"), "{msg}");
    assert!(msg.contains("uniop holds 700.00 MiB in 1 live buffers"), "{msg}");
    let s = alloc.stats();
    assert_eq!((s.alloc_retries, s.ooms, s.allocated, s.live_buffers), (2, 1, 700 * MIB, 1));
    assert!(alloc.memory_summary().contains("2 / 1"), "{}", alloc.memory_summary());

    // Freed, the block serves the next request of its size from the cache, with no refusal.
    drop(big);
    drop(alloc.allocate(700 * MIB, MemPolicy::HugeFirst).expect("the cached 700 MiB"));
    let after = alloc.stats();
    assert_eq!((after.alloc_retries, after.os_allocs, after.cache_hits), (2, s.os_allocs, s.cache_hits + 1));
}
