//! `cargo bench --bench scheduler`: the scheduler benchmark of `kvshm bench sched`, with the
//! memory per cached block measured by a counting global allocator instead of glibc's statistics.
//! Prints one JSON object.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use kvshm::cli::bench_sched::{measure, BenchOptions};

/// Bytes currently allocated through [`Counting`].
static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting the bytes it hands out and takes back.
struct Counting;

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so it upholds
// `GlobalAlloc`'s contract exactly as `System` does; the counter has no effect on the memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `alloc`'s contract (a non-zero-sized layout), passed on as is.
        let pointer = unsafe { System.alloc(layout) };
        if !pointer.is_null() {
            // Relaxed: a statistic read after the measured work on the same thread; no memory is
            // published through it.
            ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        }
        pointer
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        // SAFETY: the caller passes a pointer this allocator returned with this layout.
        unsafe { System.dealloc(pointer, layout) };
        ALLOCATED.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, pointer: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller upholds `realloc`'s contract, passed on as is.
        let moved = unsafe { System.realloc(pointer, layout, new_size) };
        if !moved.is_null() {
            ALLOCATED.fetch_sub(layout.size(), Ordering::Relaxed);
            ALLOCATED.fetch_add(new_size, Ordering::Relaxed);
        }
        moved
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn main() -> anyhow::Result<()> {
    let heap = || Some(ALLOCATED.load(Ordering::Relaxed));
    let report = measure(
        &BenchOptions::default(),
        &heap,
        "counting global allocator: bytes live before and after filling",
    )?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}
