//! Single-producer single-consumer rings of fixed-size records that live in shared memory.
//!
//! A ring carries `T: bytemuck::Pod` records from one producer to one consumer, usually in two
//! processes (commands from the scheduler to a worker, completions back). Both indices are
//! free-running u64 counts, on separate cache lines; each side owns one index and caches the
//! other's, so a push or pop touches the peer's line only when its cached view runs out.
//!
//! - `layout.rs`: the bytes of a ring, [`memory_size`], [`init`], [`reset`], validation.
//! - [`Producer`]: [`Producer::push`], [`Producer::push_all`] (a batch, one Release store).
//! - [`Consumer`]: [`Consumer::pop`], [`Consumer::pop_into`] (a batch, one Release store).
//! - [`heap()`]: the same ring on the heap, for tests and loom.
//!
//! One record's trip:
//!
//! 1. the creator sizes memory with [`memory_size`] and calls [`init`] once;
//! 2. each side attaches ([`Producer::attach`], [`Consumer::attach`]), validating the header;
//! 3. the producer writes the record into slot `tail % capacity` and stores `tail + 1` (Release);
//! 4. the consumer loads the tail (Acquire), checks it, copies the slot out and stores `head + 1`
//!    (Release), which lets the producer reuse the slot after its next Acquire load of the head.
//!
//! # Index arithmetic
//!
//! The indices count modulo 2^64: every addition and subtraction of indices wraps, on both sides,
//! so that no value the peer writes can make an index computation overflow (a panic in debug
//! builds, and in release a count of records that differs from the slots released). A ring holds
//! `tail - head` records (wrapping), which must lie in `0..=capacity`; a side only ever moves its
//! view of the peer's index forwards, within that window. At attach, where there is no earlier
//! view to compare with, the indices must also satisfy `head <= tail` as plain integers: a ring
//! never really carries 2^64 records, so indices that make sense only modulo 2^64 are a scribble
//! and the attach fails with [`RingError::Corrupt`].
//!
//! Waiting for records or for room is not the ring's business: pair it with a
//! [`Doorbell`](crate::doorbell::Doorbell).

mod consumer;
mod error;
mod heap;
mod layout;
mod producer;

pub use consumer::Consumer;
pub use error::{RingError, RingFull};
pub use heap::heap;
#[cfg(not(loom))]
pub(crate) use layout::RingView;
pub use layout::{capacity_is_valid, memory_size, MAX_CAPACITY, RING_ALIGN};
#[cfg(not(loom))]
pub use layout::{init, reset};
pub use producer::Producer;

#[cfg(all(test, not(loom)))]
mod tests;
