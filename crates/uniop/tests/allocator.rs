//! The caching allocator, in its own test binary: its counters are process-wide, so nothing else
//! may allocate concurrently.

use uniop::runtime::{Allocator, MemPolicy};
use uniop::ErrorCode;

#[test]
fn caching_stats_summary_and_leaks() {
    let alloc = Allocator::global();
    let base = alloc.stats();
    assert_eq!(base.allocated, 0);

    let small = alloc.allocate(1000, MemPolicy::HugeFirst).unwrap();
    let large = alloc.allocate(5 << 20, MemPolicy::HugeFirst).unwrap();
    assert_eq!(small.as_ptr() as usize % 64, 0);
    assert_eq!(large.as_ptr() as usize % (2 << 20), 0, "large blocks start on a huge-page boundary");
    assert!(large.is_huge_page_advised());
    let normal = alloc.allocate(3 << 20, MemPolicy::NormalOnly).unwrap();
    assert!(!normal.is_huge_page_advised());
    let s = alloc.stats();
    assert_eq!(s.live_buffers, 3);
    assert_eq!(s.requested, 1000 + (5 << 20) + (3 << 20));
    assert_eq!(s.allocated, small.capacity() + large.capacity() + normal.capacity());
    assert_eq!(large.capacity(), 6 << 20);

    let report = alloc.leak_report().expect("three live buffers");
    assert!(report.contains("3 device buffer(s) still allocated"), "{report}");

    let small_ptr = small.as_ptr();
    drop(small);
    drop(large);
    drop(normal);
    let s = alloc.stats();
    assert_eq!((s.allocated, s.requested, s.live_buffers), (0, 0, 0), "stats return to zero");
    assert!(s.reserved > 0, "freed blocks stay cached");
    assert!(alloc.leak_report().is_none());

    // Same size class: served from the cache, same block.
    let again = alloc.allocate(990, MemPolicy::HugeFirst).unwrap();
    assert_eq!(again.as_ptr(), small_ptr);
    assert_eq!(alloc.stats().cache_hits, s.cache_hits + 1);
    drop(again);

    let summary = alloc.memory_summary();
    for row in ["allocated", "peak allocated", "reserved from the OS", "served from cache"] {
        assert!(summary.contains(row), "{summary}");
    }
    assert!(alloc.stats().peak_allocated >= (10 << 20));

    alloc.empty_cache();
    assert_eq!(alloc.stats().reserved, 0);

    // Zero bytes is a valid allocation that takes nothing.
    let empty = alloc.allocate(0, MemPolicy::HugeOnly).unwrap();
    assert!(empty.is_empty());
    drop(empty);

    // HUGE_ONLY either gets a huge-page-advised block or says why it cannot.
    match alloc.allocate(100, MemPolicy::HugeOnly) {
        Ok(b) => assert!(b.is_huge_page_advised() && b.capacity() == 2 << 20),
        Err(e) => assert!(e.message().contains("transparent huge pages are disabled"), "{e}"),
    }
    alloc.empty_cache();

    let err = alloc.allocate(usize::MAX / 2 + 7, MemPolicy::HugeFirst).unwrap_err();
    assert_eq!(err.code(), ErrorCode::Runtime);
    assert_eq!(alloc.stats().allocated, 0);
}
