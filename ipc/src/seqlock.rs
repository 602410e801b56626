//! A sequence lock over u64 words in shared memory, for byte blobs that are written rarely and read
//! by other processes at any time (the tree snapshot, the CUDA device handles).
//!
//! Data words are atomics accessed Relaxed, so a torn read is a detected retry rather than a data
//! race. The version counter is even while the blob is stable and odd while a writer rewrites it.
//! Writers exclude each other through a writer word that names the writing process (its pid and
//! the low 32 bits of its start time), so that a writer that died in the middle of a write, which
//! leaves the version odd, does not lock the blob forever: the next writer finds the named process
//! gone and takes the lock over.
//!
//! Writing ([`write()`]):
//! 1. lock: CAS the writer word from 0 to this process; if it names a process that is gone
//!    (exited, or its pid reused), CAS it from that value instead; if it names a live process,
//!    [`SeqLockBusy`];
//! 2. make the version odd (a version left odd by a dead writer stays as it is), then a Release
//!    fence, then store the words;
//! 3. store the next (even) version with Release, and unlock (store 0 with Release).
//!
//! Reading ([`read()`]): load the version with Acquire (odd: busy), load the words, an Acquire fence,
//! re-load the version: a different value means a writer ran meanwhile and the copy is discarded.

use crate::liveness::ProcessIdentity;
use crate::sync::{fence, AtomicU64, Ordering};

/// Another writer holds the lock, or the reader raced with one; try again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqLockBusy;

/// The writer word of `process`: its pid, and the low 32 bits of its start time above it.
fn writer_word(process: ProcessIdentity) -> u64 {
    (process.start_time & u64::from(u32::MAX)) << 32 | u64::from(process.pid)
}

/// The live process a writer word names, if any: `None` when that process is gone (exited, a
/// zombie, or its pid reused by a process with another start time).
pub fn live_writer(word: u64) -> Option<u32> {
    let pid = word as u32;
    if word == 0 {
        return None;
    }
    let alive = match ProcessIdentity::of_pid(pid) {
        Some(now) => {
            now.start_time & u64::from(u32::MAX) == word >> 32
                && ProcessIdentity::new(pid, now.start_time).is_alive()
        }
        // No /proc entry: gone; /proc unusable: the pid check alone decides.
        None => ProcessIdentity::new(pid, 0).is_alive(),
    };
    alive.then_some(pid)
}

/// Writes `header` words and then `bytes` (packed little-endian into `data`) under `version`,
/// holding `writer` (module flow).
///
/// # Panics
/// If `bytes` does not fit `data` or `header` does not fit `header_words`: callers check sizes
/// first, so this is a programming error.
pub fn write(
    version: &AtomicU64,
    writer: &AtomicU64,
    header_words: &[AtomicU64],
    header: &[u64],
    data: &[AtomicU64],
    bytes: &[u8],
) -> Result<(), SeqLockBusy> {
    assert!(header.len() <= header_words.len(), "seqlock header overflow is a programming error");
    assert!(bytes.len() <= data.len() * 8, "seqlock data overflow is a programming error");
    let me = writer_word(ProcessIdentity::current());
    // Relaxed: only chooses the CAS below, which acquires.
    let held = writer.load(Ordering::Relaxed);
    if held == me || live_writer(held).is_some() {
        return Err(SeqLockBusy);
    }
    // SYNC: the Acquire pairs with the Release store of 0 at the end of the previous write: its
    // version store is visible below.
    writer
        .compare_exchange(held, me, Ordering::Acquire, Ordering::Relaxed)
        .map_err(|_| SeqLockBusy)?;
    // Relaxed: only the lock holder writes the version.
    let start = version.load(Ordering::Relaxed);
    // The version lies in shared memory: it wraps rather than overflow, whatever was written there.
    let odd = if start % 2 == 1 { start } else { start.wrapping_add(1) };
    // Relaxed: the fence below orders it before the data stores.
    version.store(odd, Ordering::Relaxed);
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
    version.store(odd.wrapping_add(1), Ordering::Release);
    // SYNC: pairs with the Acquire CAS of the next writer's lock above.
    writer.store(0, Ordering::Release);
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
    // Relaxed: ordered by the fence above.
    if version.load(Ordering::Relaxed) != before {
        return Err(SeqLockBusy);
    }
    Ok((header, bytes))
}

#[cfg(test)]
mod tests {
    use std::process::{Command, Stdio};

    use super::*;

    fn words(n: usize) -> Vec<AtomicU64> {
        (0..n).map(|_| AtomicU64::new(0)).collect()
    }

    /// The writer word of a process that ran and is gone (spawned, exited, reaped).
    fn dead_writer() -> u64 {
        let mut child = Command::new("true").spawn().expect("spawning true");
        let identity =
            ProcessIdentity::of_pid(child.id()).unwrap_or(ProcessIdentity::new(child.id(), 1));
        child.wait().unwrap();
        writer_word(identity)
    }

    #[test]
    fn a_written_blob_reads_back_and_the_lock_is_free_after() {
        let (version, writer) = (AtomicU64::new(0), AtomicU64::new(0));
        let (header, data) = (words(2), words(4));
        write(&version, &writer, &header, &[5, 11], &data, b"hello, seqlock").unwrap();
        let (read_header, bytes) = read(&version, &header, &data, |h| h[1] as usize).unwrap();
        assert_eq!(read_header, vec![5, 11]);
        assert_eq!(bytes, b"hello, seql");
        assert_eq!(version.load(Ordering::Relaxed), 2);
        assert_eq!(writer.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn readers_and_writers_back_off_while_a_live_writer_holds_the_lock() {
        let mut other = Command::new("sleep").arg("60").stdout(Stdio::null()).spawn().unwrap();
        let other_word = writer_word(ProcessIdentity::of_pid(other.id()).unwrap());
        let me = writer_word(ProcessIdentity::current());
        let (header, data) = (words(1), words(1));
        for held in [other_word, me] {
            let (version, writer) = (AtomicU64::new(3), AtomicU64::new(held));
            assert_eq!(read(&version, &header, &data, |_| 8), Err(SeqLockBusy));
            assert_eq!(write(&version, &writer, &header, &[1], &data, b"x"), Err(SeqLockBusy));
            assert_eq!(writer.load(Ordering::Relaxed), held);
        }
        assert_eq!(live_writer(other_word), Some(other.id()));
        other.kill().unwrap();
        other.wait().unwrap();
        assert_eq!(live_writer(other_word), None);
    }

    #[test]
    fn a_writer_that_died_in_the_middle_of_a_write_is_taken_over_by_the_next() {
        // What a publisher killed between its odd and its even version leaves behind.
        let (version, writer) = (AtomicU64::new(7), AtomicU64::new(dead_writer()));
        let (header, data) = (words(1), words(1));
        assert_eq!(read(&version, &header, &data, |_| 8), Err(SeqLockBusy));
        write(&version, &writer, &header, &[4], &data, b"new").unwrap();
        assert_eq!(version.load(Ordering::Relaxed), 8);
        assert_eq!(read(&version, &header, &data, |_| 3).unwrap(), (vec![4], b"new".to_vec()));
    }

    #[test]
    fn an_odd_version_that_names_no_writer_is_repaired_by_the_next_write() {
        let (version, writer) = (AtomicU64::new(5), AtomicU64::new(0));
        let (header, data) = (words(1), words(1));
        write(&version, &writer, &header, &[1], &data, b"x").unwrap();
        assert_eq!(read(&version, &header, &data, |_| 1).unwrap(), (vec![1], b"x".to_vec()));
    }

    #[test]
    fn a_version_about_to_wrap_is_written_and_read_without_overflow() {
        let (version, writer) = (AtomicU64::new(u64::MAX - 1), AtomicU64::new(0));
        let (header, data) = (words(1), words(1));
        write(&version, &writer, &header, &[3], &data, b"ab").unwrap();
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
