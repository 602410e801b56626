//! The scheduler's hot path allocates no memory: a perf regression check in the test command.
//!
//! A counting global allocator counts the allocations of this test's own thread while the
//! replay serves a slice of the Mooncake trace, after a warm-up that lets every buffer grow to
//! the slice's needs. Serving a request (poll, match, allocate, copies, commit, finish) must then
//! allocate nothing; the only allocations allowed are a buffer growing to a new largest request,
//! a handful over the whole slice. The figure is a count, not a time, so it does not depend on
//! the machine's load.
//!
//! It shares the scheduler's test binary, whose every test then allocates through the counting
//! allocator, without changing what it measures: the allocator forwards to `System` (what the
//! binary would use anyway), and the count is the measuring thread's own, while the harness
//! runs each test on a thread of its own, so the other tests' allocations never reach it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use kvshm::cli::replay::Replayer;
use kvshm::manager::{CacheConfig, WritePolicy};
use kvshm::trace::read_trace;

thread_local! {
    /// Allocations (and reallocations) made by the current thread.
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

/// The system allocator, counting each thread's allocations.
struct Counting;

fn count() {
    // `try_with`: a thread being torn down has no counter left; its allocations do not matter.
    let _ = ALLOCATIONS.try_with(|count| count.set(count.get() + 1));
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so it upholds
// `GlobalAlloc`'s contract exactly as `System` does; the counter (a const-initialised thread
// local, which never allocates) has no effect on the memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller upholds `alloc`'s contract (a non-zero-sized layout), passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        // SAFETY: the caller passes a pointer this allocator returned with this layout.
        unsafe { System.dealloc(pointer, layout) }
    }

    unsafe fn realloc(&self, pointer: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: the caller upholds `realloc`'s contract for a pointer from this allocator.
        unsafe { System.realloc(pointer, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const WARM_UP: usize = 3_000;
const MEASURED: usize = 3_000;
/// Buffers reaching a new size over the measured requests (a longer prompt than any before).
const ALLOWED: u64 = 16;

#[test]
fn serving_a_request_allocates_nothing_once_the_buffers_have_grown() {
    let trace = read_trace(&crate::support::mooncake_trace(), Some(WARM_UP + MEASURED))
        .expect("the trace reads");
    let configs = [
        CacheConfig::new(512, 1_953),
        CacheConfig::new(512, 1_953).with_host_blocks(7_812),
        CacheConfig::new(512, 1_953)
            .with_host_blocks(7_812)
            .with_write_policy(WritePolicy::WriteThrough)
            .with_free_watermark(32),
        // As the replay runs it: `poll` issues the backups alone.
        CacheConfig::new(512, 1_953)
            .with_host_blocks(7_812)
            .with_write_policy(WritePolicy::WriteThrough),
        CacheConfig::new(512, 1_953)
            .with_host_blocks(7_812)
            .with_write_policy(WritePolicy::WriteThroughSelective { threshold: 2 }),
        // A host tier small enough that blocks go on to storage and come back.
        CacheConfig::new(512, 1_953).with_host_blocks(1_953).with_storage_blocks(39_062),
    ];
    for config in configs {
        let name = format!("{config:?}");
        let mut replayer = Replayer::new(config, false, trace.len()).unwrap();
        for request in &trace[..WARM_UP] {
            replayer.serve(request).unwrap();
        }
        let before = ALLOCATIONS.with(Cell::get);
        for request in &trace[WARM_UP..] {
            replayer.serve(request).unwrap();
        }
        let allocations = ALLOCATIONS.with(Cell::get) - before;
        println!("{allocations} allocations serving {MEASURED} requests with {name}");
        assert!(
            allocations <= ALLOWED,
            "{allocations} allocations serving {MEASURED} requests with {name}"
        );
        let report = replayer.finish().report;
        assert!(report.hit_blocks > 0 && report.failed_requests == 0, "{report:?}");
        if report.storage_blocks > 0 {
            assert!(report.storage_stores > 0 && report.storage_loads > 0, "{report:?}");
        }
    }
}
