//! Copying bytes between this process's buffers and shared memory that other processes write,
//! without a data race in this process.
//!
//! Every access to the shared side is an atomic (Relaxed) load or store: whole aligned u64 words,
//! and single bytes at the unaligned ends. Another process writing the same bytes at the same time
//! can leave the copy inconsistent (some words old, some new), never undefined: this process sees
//! only atomic accesses to that memory. Callers that need consistent bytes keep to a protocol that
//! keeps writers away (the cache's block ownership); this module makes breaking it harmless to
//! the reader's soundness.
//!
//! Flow of a copy: 1. bytes one at a time up to the first 8-aligned shared address; 2. whole
//! words; 3. the remaining bytes one at a time.

use crate::sync::{AtomicU64, AtomicU8, Ordering};

/// Copies `out.len()` bytes of shared memory starting at `src` into `out`.
///
/// # Safety
///
/// `src` is valid for reads of `out.len()` bytes for the duration of the call (a mapping that
/// outlives it). Other processes may write those bytes meanwhile.
pub unsafe fn copy_from_shared(src: *const u8, out: &mut [u8]) {
    let head = src.align_offset(8).min(out.len());
    let words = (out.len() - head) / 8;
    for (index, byte) in out[..head].iter_mut().enumerate() {
        // SAFETY: in bounds (index < out.len(), the caller's premise); an AtomicU8 has the size
        // and alignment of a u8; Relaxed: a copy, nothing is published behind these bytes.
        *byte = unsafe { &*src.add(index).cast::<AtomicU8>() }.load(Ordering::Relaxed);
    }
    for word in 0..words {
        let at = head + word * 8;
        // SAFETY: in bounds as above; `src + head` is 8-aligned, so is every word after it, and
        // an AtomicU64 has the size and alignment of a u64. Relaxed as above.
        let value = unsafe { &*src.add(at).cast::<AtomicU64>() }.load(Ordering::Relaxed);
        out[at..at + 8].copy_from_slice(&value.to_ne_bytes());
    }
    let tail = head + words * 8;
    for (index, byte) in out.iter_mut().enumerate().skip(tail) {
        // SAFETY: as for the head bytes.
        *byte = unsafe { &*src.add(index).cast::<AtomicU8>() }.load(Ordering::Relaxed);
    }
}

/// Copies `bytes` into shared memory starting at `dst`.
///
/// # Safety
///
/// `dst` is valid for writes of `bytes.len()` bytes for the duration of the call (a mapping that
/// outlives it), and `bytes` does not lie in it. Other processes may read or write those bytes
/// meanwhile.
pub unsafe fn copy_to_shared(bytes: &[u8], dst: *mut u8) {
    let head = dst.align_offset(8).min(bytes.len());
    let words = (bytes.len() - head) / 8;
    for (index, &byte) in bytes[..head].iter().enumerate() {
        // SAFETY: in bounds (the caller's premise); an AtomicU8 has the layout of a u8; Relaxed:
        // the bytes publish nothing, the protocol around the copy orders them.
        unsafe { &*dst.add(index).cast::<AtomicU8>() }.store(byte, Ordering::Relaxed);
    }
    for word in 0..words {
        let at = head + word * 8;
        let value = u64::from_ne_bytes(bytes[at..at + 8].try_into().expect("eight bytes"));
        // SAFETY: in bounds as above; `dst + head` is 8-aligned, so is every word after it, and
        // an AtomicU64 has the layout of a u64. Relaxed as above.
        unsafe { &*dst.add(at).cast::<AtomicU64>() }.store(value, Ordering::Relaxed);
    }
    let tail = head + words * 8;
    for (index, &byte) in bytes.iter().enumerate().skip(tail) {
        // SAFETY: as for the head bytes.
        unsafe { &*dst.add(index).cast::<AtomicU8>() }.store(byte, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_of_every_alignment_and_length_round_trip() {
        let mut shared = vec![0u64; 16];
        let base = shared.as_mut_ptr().cast::<u8>();
        for start in 0..9 {
            for len in [0, 1, 7, 8, 9, 15, 16, 17, 63, 64] {
                let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + start + 1) as u8).collect();
                // SAFETY: start + len <= 73 < 128 bytes of `shared`, which outlives the calls and
                // is not aliased by a reference meanwhile; one thread.
                unsafe { copy_to_shared(&bytes, base.add(start)) };
                let mut out = vec![0u8; len];
                // SAFETY: as above.
                unsafe { copy_from_shared(base.add(start), &mut out) };
                assert_eq!(out, bytes, "start {start} len {len}");
            }
        }
    }
}
