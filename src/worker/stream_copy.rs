//! Copying rows of a swap with non-temporal stores, and the fence that publishes them.
//!
//! A swap writes bytes nobody reads soon (a host block written by a swap-out is read at the
//! earliest by a later swap-in), spread over far more memory than the caches hold. Ordinary stores
//! first read every destination line into the cache (read for ownership) and then evict it again:
//! three memory transfers per line instead of two. glibc's memcpy switches to non-temporal
//! stores only for copies of several MiB, and a swap copies rows of a few KiB, so the host engine
//! streams its rows itself: on x86_64, 16-byte unaligned loads and `movntdq` stores (SSE2, part of
//! the x86_64 baseline, no run-time detection). Measured on the bench machine, 2 KiB rows moved
//! at about twice the rate of memcpy this way. Elsewhere it is a plain copy.
//!
//! Non-temporal stores are weakly ordered: a later Release store (a progress counter, a
//! completion pushed into a ring) may become visible before them. [`store_fence`] (`sfence`) must
//! run after the last streamed row and before anything that publishes the copy.

/// Rows shorter than this go through memcpy: partial-line streaming stores are slow.
pub const STREAMING_MIN_BYTES: usize = 1024;

/// Copies `len` bytes from `src` to `dst`, with non-temporal stores when `len >=
/// STREAMING_MIN_BYTES` on x86_64. Call [`store_fence`] before publishing the copied bytes.
///
/// # Safety
///
/// `src` is valid for reads and `dst` for writes of `len` bytes, and the two ranges do not overlap
/// (as for `std::ptr::copy_nonoverlapping`); no other thread or process writes `src` or accesses
/// `dst` during the copy (no data race: these are plain loads and stores).
pub unsafe fn copy_rows_streaming(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= STREAMING_MIN_BYTES {
        // SAFETY: forwarded from this function's contract.
        unsafe { x86_64::copy_streaming(src, dst, len) };
        return;
    }
    // SAFETY: forwarded from this function's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// Orders every earlier non-temporal store before every later store (`sfence` on x86_64; nothing
/// to do elsewhere, where [`copy_rows_streaming`] uses ordinary stores).
pub fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no memory operands; SSE is part of the x86_64 baseline.
    #[allow(unused_unsafe)]
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(target_arch = "x86_64")]
mod x86_64 {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};

    /// # Safety
    ///
    /// As [`super::copy_rows_streaming`].
    pub unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) {
        // Ordinary copies for the unaligned head (until `dst` is 16-byte aligned) and the tail
        // shorter than 64 bytes; streaming stores, four per 64-byte line, in between.
        let head = dst.align_offset(16).min(len);
        let body = (len - head) & !63;
        let tail = len - head - body;
        // SAFETY: (contract) `src`/`dst` are valid for `len = head + body + tail` bytes and do not
        // overlap, so every sub-range below is valid and disjoint too; `dst + head` is 16-byte
        // aligned as `_mm_stream_si128` requires (and stays so in steps of 16); loads are unaligned.
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            let (src_body, dst_body) = (src.add(head), dst.add(head));
            let mut at = 0;
            while at < body {
                let s = src_body.add(at).cast::<__m128i>();
                let d = dst_body.add(at).cast::<__m128i>();
                let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
                let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
                at += 64;
            }
            std::ptr::copy_nonoverlapping(src_body.add(body), dst_body.add(body), tail);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_rows_arrive_whole_at_every_alignment_and_length() {
        let source: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in [0, 1, 63, STREAMING_MIN_BYTES - 1, STREAMING_MIN_BYTES, 2048, 4000, 4097] {
            for dst_shift in [0, 1, 8, 15] {
                for src_shift in [0, 3] {
                    let mut destination = vec![0u8; 8192];
                    // SAFETY: both ranges lie inside their vectors (shift + len <= 8192) and the
                    // vectors are distinct.
                    unsafe {
                        copy_rows_streaming(
                            source.as_ptr().add(src_shift),
                            destination.as_mut_ptr().add(dst_shift),
                            len,
                        )
                    };
                    store_fence();
                    assert_eq!(
                        &destination[dst_shift..dst_shift + len],
                        &source[src_shift..src_shift + len],
                        "len {len} dst+{dst_shift} src+{src_shift}"
                    );
                    assert!(destination[..dst_shift].iter().all(|&b| b == 0));
                    assert!(destination[dst_shift + len..].iter().all(|&b| b == 0));
                }
            }
        }
    }
}
