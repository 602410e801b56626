//! Views of the bytes of one block that a storage call reads from ([`BlockBytes`]) or writes into
//! ([`BlockBytesMut`]), without a Rust reference to them.
//!
//! The bytes are usually a host block: shared memory that other processes map and write. As
//! everywhere in kvshm, such bytes are reached through raw pointers only: system calls take the
//! pointer (`pwritev`, `preadv`), and everything else copies through it ([`BlockBytes::chunks`]
//! copies into a small buffer of this thread's, [`BlockBytesMut::copy_from`] copies in). Freedom
//! from data races on them is the block-ownership premise of the copy engines: while a storage
//! command runs, no process writes the blocks it stores, and no process touches the blocks it
//! loads into (trusted peer).
//!
//! Memory the caller owns (a `Vec`, an [`AlignedBuf`](super::direct_io::AlignedBuf)) makes a view
//! safely ([`BlockBytes::new`], [`BlockBytesMut::new`]); shared memory makes one with the unsafe
//! `from_raw` constructors, whose callers state the premise.

use std::marker::PhantomData;
use std::ptr::NonNull;

/// Bytes a chunked read copies at a time (fits in L1 with room to spare).
const CHUNK: usize = 4096;

/// A block's bytes to be read, as `&'a [u8]` would be, but reached through a raw pointer.
#[derive(Clone, Copy, Debug)]
pub struct BlockBytes<'a> {
    ptr: NonNull<u8>,
    len: usize,
    _borrow: PhantomData<&'a [u8]>,
}

// SAFETY: a view stands for a shared borrow of bytes (by `new`, or by `from_raw`'s premise that no
// one writes them while it lives); reading them from several threads is as sound as sharing a
// `&[u8]`.
unsafe impl Send for BlockBytes<'_> {}
// SAFETY: as for Send.
unsafe impl Sync for BlockBytes<'_> {}

impl<'a> BlockBytes<'a> {
    /// A view of memory this process owns.
    pub fn new(bytes: &'a [u8]) -> BlockBytes<'a> {
        BlockBytes { ptr: NonNull::from(bytes).cast(), len: bytes.len(), _borrow: PhantomData }
    }

    /// A view of `len` bytes at `ptr`.
    ///
    /// # Safety
    ///
    /// For `'a`: the bytes are mapped and readable in this process, and no thread or process
    /// writes them (trusted peer: the block-ownership protocol keeps a stored block unwritten).
    pub unsafe fn from_raw(ptr: NonNull<u8>, len: usize) -> BlockBytes<'a> {
        BlockBytes { ptr, len, _borrow: PhantomData }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// For system calls (`pwritev`) only.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The view without its first `n` bytes (all of them when `n >= len`).
    pub fn skip(self, n: usize) -> BlockBytes<'a> {
        let n = n.min(self.len);
        // SAFETY: `n <= len`, so the new start lies inside (or one past the end of) the view.
        let ptr = unsafe { NonNull::new_unchecked(self.ptr.as_ptr().add(n)) };
        BlockBytes { ptr, len: self.len - n, _borrow: PhantomData }
    }

    /// The view's first `n` bytes (all of them when `n >= len`).
    pub fn take(self, n: usize) -> BlockBytes<'a> {
        BlockBytes { len: n.min(self.len), ..self }
    }

    /// Copies the bytes into `out` (exactly `len` bytes long).
    ///
    /// # Panics
    ///
    /// If `out` has another length: a programming error of the caller.
    pub fn copy_to(&self, out: &mut [u8]) {
        assert_eq!(out.len(), self.len, "copying a block into a buffer of another size");
        // SAFETY: the view's bytes are readable and unwritten for 'a (constructor premise);
        // `out` is a distinct, writable slice of the same length (a &mut cannot alias them).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), out.as_mut_ptr(), self.len) };
    }

    /// Calls `each` with the bytes in order, a chunk at a time, each chunk copied into a buffer
    /// of this thread's first (so no reference to the block's own bytes is ever formed).
    pub fn chunks(&self, mut each: impl FnMut(&[u8])) {
        let mut buffer = [0u8; CHUNK];
        let mut done = 0;
        while done < self.len {
            let take = CHUNK.min(self.len - done);
            // SAFETY: `done + take <= len`, inside the view's readable, unwritten bytes; the
            // buffer is this stack frame's.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.ptr.as_ptr().add(done),
                    buffer.as_mut_ptr(),
                    take,
                )
            };
            each(&buffer[..take]);
            done += take;
        }
    }
}

/// A block's bytes to be written, as `&'a mut [u8]` would be, but reached through a raw pointer.
#[derive(Debug)]
pub struct BlockBytesMut<'a> {
    ptr: NonNull<u8>,
    len: usize,
    _borrow: PhantomData<&'a mut [u8]>,
}

// SAFETY: a view stands for an exclusive borrow of bytes (by `new`, or by `from_raw`'s premise);
// moving it to another thread moves that exclusivity, as for `&mut [u8]`.
unsafe impl Send for BlockBytesMut<'_> {}

impl<'a> BlockBytesMut<'a> {
    /// A view of memory this process owns.
    pub fn new(bytes: &'a mut [u8]) -> BlockBytesMut<'a> {
        BlockBytesMut {
            ptr: NonNull::from(&mut *bytes).cast(),
            len: bytes.len(),
            _borrow: PhantomData,
        }
    }

    /// A view of `len` bytes at `ptr`.
    ///
    /// # Safety
    ///
    /// For `'a`: the bytes are mapped, readable and writable in this process, no other view or
    /// reference to them exists in this process, and no other process reads or writes them
    /// (trusted peer: the block-ownership protocol gives a LOAD its destinations alone).
    pub unsafe fn from_raw(ptr: NonNull<u8>, len: usize) -> BlockBytesMut<'a> {
        BlockBytesMut { ptr, len, _borrow: PhantomData }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// For system calls (`preadv`) only.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The view without its first `n` bytes (all of them when `n >= len`).
    pub fn skip(self, n: usize) -> BlockBytesMut<'a> {
        let n = n.min(self.len);
        // SAFETY: `n <= len`, so the new start lies inside (or one past the end of) the view.
        let ptr = unsafe { NonNull::new_unchecked(self.ptr.as_ptr().add(n)) };
        BlockBytesMut { ptr, len: self.len - n, _borrow: PhantomData }
    }

    /// The same view, borrowing this one (for a call that consumes views).
    pub fn reborrow(&mut self) -> BlockBytesMut<'_> {
        BlockBytesMut { ptr: self.ptr, len: self.len, _borrow: PhantomData }
    }

    /// The same bytes, to be read (for verifying what was written into them).
    pub fn as_bytes(&self) -> BlockBytes<'_> {
        // SAFETY: while the returned view lives, `self` is borrowed, so nothing writes through it;
        // the premise of `self` keeps everyone else off the bytes.
        unsafe { BlockBytes::from_raw(self.ptr, self.len) }
    }

    /// Copies `bytes` (exactly `len` bytes) in.
    ///
    /// # Panics
    ///
    /// If `bytes` has another length: a programming error of the caller.
    pub fn copy_from(&mut self, bytes: &[u8]) {
        assert_eq!(bytes.len(), self.len, "copying a buffer of another size into a block");
        // SAFETY: the view's bytes are writable and ours alone for 'a (constructor premise);
        // `bytes` is a distinct slice (a shared reference cannot alias an exclusive view).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.as_ptr(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_visit_every_byte_in_order() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let mut seen = Vec::new();
        BlockBytes::new(&bytes).chunks(|chunk| seen.extend_from_slice(chunk));
        assert_eq!(seen, bytes);
        let mut copy = vec![0u8; bytes.len()];
        BlockBytes::new(&bytes).copy_to(&mut copy);
        assert_eq!(copy, bytes);
    }

    #[test]
    fn a_mutable_view_takes_bytes_and_shows_them() {
        let mut dest = vec![0u8; 5000];
        let mut view = BlockBytesMut::new(&mut dest);
        view.copy_from(&[7u8; 5000]);
        let mut seen = 0usize;
        view.as_bytes().chunks(|chunk| seen += chunk.iter().filter(|&&b| b == 7).count());
        assert_eq!(seen, 5000);
        assert!(dest.iter().all(|&b| b == 7));
    }
}
