//! A sequence lock over u64 words in shared memory, for byte blobs that are written rarely and read
//! by other processes at any time (the tree snapshot, the CUDA device handles).
//!
//! Data words are atomics accessed Relaxed, so a torn read is a detected retry rather than a data
//! race. The version counter is even while the blob is stable and odd while a writer rewrites it.
//!
//! Writing ([`write()`]):
//! 1. claim the lock by a CAS of the version from even `v` to `v + 1` (a second writer gets
//!    [`SeqLockBusy`] instead of interleaving its bytes);
//! 2. a Release fence, then store the words;
//! 3. store `v + 2` with Release.
//!
//! Reading ([`read()`]): load the version with Acquire (odd: busy), load the words, an Acquire fence,
//! re-load the version: a different value means a writer ran meanwhile and the copy is discarded.

use crate::sync::{fence, AtomicU64, Ordering};

/// Another writer holds the lock, or the reader raced with one; try again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqLockBusy;

/// Writes `header` words and then `bytes` (packed little-endian into `data`) under `version`.
///
/// # Panics
/// If `bytes` does not fit `data` or `header` does not fit `header_words`: callers check sizes
/// first, so this is a programming error.
pub fn write(
    version: &AtomicU64,
    header_words: &[AtomicU64],
    header: &[u64],
    data: &[AtomicU64],
    bytes: &[u8],
) -> Result<(), SeqLockBusy> {
    assert!(header.len() <= header_words.len(), "seqlock header overflow is a programming error");
    assert!(bytes.len() <= data.len() * 8, "seqlock data overflow is a programming error");
    let start = version.load(Ordering::Relaxed);
    if start % 2 == 1 {
        return Err(SeqLockBusy);
    }
    // The version lies in shared memory: it wraps rather than overflow, whatever was written there.
    // SYNC: the Acquire half orders us after the previous writer's Release store of the version.
    version
        .compare_exchange(start, start.wrapping_add(1), Ordering::Acquire, Ordering::Relaxed)
        .map_err(|_| SeqLockBusy)?;
    // SYNC: keeps the odd version visible before any data store below; pairs with the Acquire
    // fence in read(), so a reader that saw a data store also sees the version change.
    fence(Ordering::Release);
    for (word, value) in header_words.iter().zip(header) {
        word.store(*value, Ordering::Relaxed);
    }
    for (word, chunk) in data.iter().zip(bytes.chunks(8)) {
        let mut buffer = [0u8; 8];
        buffer[..chunk.len()].copy_from_slice(chunk);
        word.store(u64::from_le_bytes(buffer), Ordering::Relaxed);
    }
    // SYNC: publishes the words; pairs with the Acquire load of the version in read().
    version.store(start.wrapping_add(2), Ordering::Release);
    Ok(())
}

/// Reads the header words, then lets `len_of(header)` say how many data bytes to copy (clamped to
/// the data area), and returns both if no writer ran meanwhile.
pub fn read(
    version: &AtomicU64,
    header_words: &[AtomicU64],
    data: &[AtomicU64],
    len_of: impl FnOnce(&[u64]) -> usize,
) -> Result<(Vec<u64>, Vec<u8>), SeqLockBusy> {
    // SYNC: pairs with the Release store of the version at the end of write().
    let before = version.load(Ordering::Acquire);
    if before % 2 == 1 {
        return Err(SeqLockBusy);
    }
    let header: Vec<u64> = header_words.iter().map(|word| word.load(Ordering::Relaxed)).collect();
    let len = len_of(&header).min(data.len() * 8);
    let mut bytes = Vec::with_capacity(len);
    for word in &data[..len.div_ceil(8)] {
        bytes.extend_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
    }
    bytes.truncate(len);
    // SYNC: pairs with the Release fence in write(): if any load above saw a newer writer's store,
    // the version load below sees that writer's odd (or later) version.
    fence(Ordering::Acquire);
    if version.load(Ordering::Relaxed) != before {
        return Err(SeqLockBusy);
    }
    Ok((header, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(n: usize) -> Vec<AtomicU64> {
        (0..n).map(|_| AtomicU64::new(0)).collect()
    }

    #[test]
    fn a_written_blob_reads_back() {
        let version = AtomicU64::new(0);
        let (header, data) = (words(2), words(4));
        write(&version, &header, &[5, 11], &data, b"hello, seqlock").unwrap();
        let (read_header, bytes) = read(&version, &header, &data, |h| h[1] as usize).unwrap();
        assert_eq!(read_header, vec![5, 11]);
        assert_eq!(bytes, b"hello, seql");
        assert_eq!(version.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn readers_and_writers_back_off_while_a_write_is_in_progress() {
        let version = AtomicU64::new(3);
        let (header, data) = (words(1), words(1));
        assert_eq!(read(&version, &header, &data, |_| 8), Err(SeqLockBusy));
        assert_eq!(write(&version, &header, &[1], &data, b"x"), Err(SeqLockBusy));
    }

    #[test]
    fn a_version_about_to_wrap_is_written_and_read_without_overflow() {
        let version = AtomicU64::new(u64::MAX - 1);
        let (header, data) = (words(1), words(1));
        write(&version, &header, &[3], &data, b"ab").unwrap();
        assert_eq!(version.load(Ordering::Relaxed), 0);
        assert_eq!(read(&version, &header, &data, |_| 2).unwrap(), (vec![3], b"ab".to_vec()));
    }

    #[test]
    fn a_length_beyond_the_area_is_clamped() {
        let version = AtomicU64::new(0);
        let (header, data) = (words(1), words(1));
        let (_, bytes) = read(&version, &header, &data, |_| usize::MAX).unwrap();
        assert_eq!(bytes.len(), 8);
    }
}
