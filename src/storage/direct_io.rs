//! File I/O for the disk back-end: O_DIRECT where the file system allows it, page-aligned
//! buffers, vectored positional reads and writes that finish or fail whole, preallocation, and a
//! lock so that one process at a time owns a slab.
//!
//! Core items: [`DataFile`] (the slab's file descriptor and its [`IoMode`]), [`AlignedBuf`],
//! [`write_all_at`] / [`read_exact_at`], [`preallocate`], [`lock_exclusive`], [`failure_of`].
//!
//! Opening a slab's data file ([`DataFile::open`]):
//!
//! 1. open it buffered (`O_RDWR`), which every file system allows;
//! 2. try to open it again with `O_DIRECT`; if the open is refused (`EINVAL`: tmpfs and some
//!    FUSE file systems), or a probe read of one aligned block at offset 0 is refused, keep the
//!    buffered descriptor ([`IoMode::Buffered`]);
//! 3. otherwise use the direct descriptor ([`IoMode::Direct`]): every transfer then starts at a
//!    multiple of [`IO_ALIGN`], is a multiple of it long, and every buffer address is a multiple
//!    of it. The caller (the disk back-end) guarantees that, bouncing through an [`AlignedBuf`]
//!    when a host block is not aligned that way.

use std::alloc::{self, Layout};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::ptr::NonNull;

use super::backend::Failure;
use super::block_bytes::{BlockBytes, BlockBytesMut};

/// Alignment of every direct transfer: offsets, lengths and buffer addresses (the page size,
/// which is at least the logical block size of every common device).
pub const IO_ALIGN: usize = 4096;

/// Whether the page cache is bypassed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IoMode {
    /// `O_DIRECT`: transfers go between the buffers and the device.
    Direct,
    /// Through the page cache (the file system refused `O_DIRECT`).
    Buffered,
}

impl IoMode {
    pub fn name(self) -> &'static str {
        match self {
            IoMode::Direct => "direct",
            IoMode::Buffered => "buffered",
        }
    }
}

/// A slab's data file, opened as the file system allows (module documentation).
#[derive(Debug)]
pub struct DataFile {
    file: File,
    mode: IoMode,
}

impl DataFile {
    /// Opens (creating when `create`) the file at `path`, with `O_DIRECT` where allowed.
    /// `prefer_direct: false` opens it buffered without trying.
    pub fn open(path: &Path, create: bool, prefer_direct: bool) -> io::Result<DataFile> {
        let buffered =
            OpenOptions::new().read(true).write(true).create(create).mode(0o600).open(path)?;
        if !prefer_direct {
            return Ok(DataFile { file: buffered, mode: IoMode::Buffered });
        }
        let direct =
            OpenOptions::new().read(true).write(true).custom_flags(libc::O_DIRECT).open(path);
        match direct {
            Ok(direct) if probe_direct(&direct) => {
                Ok(DataFile { file: direct, mode: IoMode::Direct })
            }
            Ok(_) => Ok(DataFile { file: buffered, mode: IoMode::Buffered }),
            Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {
                Ok(DataFile { file: buffered, mode: IoMode::Buffered })
            }
            Err(error) => Err(error),
        }
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn mode(&self) -> IoMode {
        self.mode
    }
}

/// Whether a direct read of one aligned block at offset 0 works (a file shorter than that reads
/// zero bytes, which also proves the flags are accepted).
fn probe_direct(file: &File) -> bool {
    let mut buf = AlignedBuf::zeroed(IO_ALIGN);
    read_some_at(file, &mut [buf.bytes_mut()], 0).is_ok()
}

/// A zero-initialised heap buffer whose address and length are multiples of [`IO_ALIGN`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is uniquely owned heap memory of plain bytes; moving it to another thread
// moves that ownership.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of `len` bytes rounded up to [`IO_ALIGN`] (at least one block).
    ///
    /// # Panics
    ///
    /// If the length overflows a layout or the allocation fails (out of memory).
    pub fn zeroed(len: usize) -> AlignedBuf {
        let len = len.max(1).div_ceil(IO_ALIGN) * IO_ALIGN;
        let layout = Layout::from_size_align(len, IO_ALIGN).expect("an aligned buffer layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else { alloc::handle_alloc_error(layout) };
        AlignedBuf { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes owned by self, borrowed immutably with self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` initialised bytes owned by self, borrowed mutably with self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The whole buffer as a view to write from.
    pub fn bytes(&self) -> BlockBytes<'_> {
        BlockBytes::new(self.as_slice())
    }

    /// The whole buffer as a view to read into.
    pub fn bytes_mut(&mut self) -> BlockBytesMut<'_> {
        BlockBytesMut::new(self.as_mut_slice())
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout =
            Layout::from_size_align(self.len, IO_ALIGN).expect("the layout it was made with");
        // SAFETY: allocated in `zeroed` with exactly this layout, freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// Whether a buffer of `len` bytes at `ptr` may be handed to a direct transfer as is.
pub fn is_aligned(ptr: *const u8, len: usize) -> bool {
    ptr as usize % IO_ALIGN == 0 && len % IO_ALIGN == 0
}

/// The most buffers one vectored call takes (`IOV_MAX` on Linux).
const MAX_IOVECS: usize = 1024;

/// Writes every byte of `bufs`, back to back, starting at `offset` (retrying short writes and
/// interruptions).
pub fn write_all_at(file: &File, bufs: &[BlockBytes<'_>], mut offset: u64) -> io::Result<()> {
    let mut pending: Vec<BlockBytes<'_>> = bufs.iter().copied().filter(|b| !b.is_empty()).collect();
    let mut first = 0;
    while first < pending.len() {
        let batch = &pending[first..(first + MAX_IOVECS).min(pending.len())];
        let iovecs: Vec<libc::iovec> = batch
            .iter()
            .map(|buf| libc::iovec {
                iov_base: buf.as_ptr() as *mut libc::c_void,
                iov_len: buf.len(),
            })
            .collect();
        let position =
            libc::off_t::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
        // SAFETY: every iovec describes the readable bytes of a live view; pwritev only reads
        // them (the kernel's copy or DMA is the raw access the views stand for).
        let written = unsafe {
            libc::pwritev(file.as_raw_fd(), iovecs.as_ptr(), iovecs.len() as libc::c_int, position)
        };
        if written < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        if written == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "pwritev wrote nothing"));
        }
        let mut written = written as usize;
        offset += written as u64;
        while written > 0 {
            let buf = pending[first];
            if written >= buf.len() {
                written -= buf.len();
                first += 1;
            } else {
                pending[first] = buf.skip(written);
                written = 0;
            }
        }
    }
    Ok(())
}

/// Fills every byte of `bufs`, back to back, from `offset`; a file that ends first is
/// `UnexpectedEof`.
pub fn read_exact_at(file: &File, bufs: &mut [BlockBytesMut<'_>], offset: u64) -> io::Result<()> {
    let mut pending: Vec<BlockBytesMut<'_>> =
        bufs.iter_mut().map(|buf| buf.reborrow()).filter(|buf| !buf.is_empty()).collect();
    let mut first = 0;
    let mut done = 0u64;
    while first < pending.len() {
        let read = read_some_at(file, &mut pending[first..], offset + done)?;
        if read == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the slab file ends early"));
        }
        done += read as u64;
        let mut read = read;
        while read > 0 {
            let len = pending[first].len();
            if read >= len {
                read -= len;
                first += 1;
            } else {
                let rest = std::mem::replace(&mut pending[first], BlockBytesMut::new(&mut []));
                pending[first] = rest.skip(read);
                read = 0;
            }
        }
    }
    Ok(())
}

/// One `preadv` into the buffers (at most [`MAX_IOVECS`]), retried on interruption.
fn read_some_at(file: &File, bufs: &mut [BlockBytesMut<'_>], offset: u64) -> io::Result<usize> {
    let iovecs: Vec<libc::iovec> = bufs
        .iter_mut()
        .take(MAX_IOVECS)
        .map(|buf| libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() })
        .collect();
    if iovecs.is_empty() {
        return Ok(0);
    }
    let position =
        libc::off_t::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    loop {
        // SAFETY: every iovec describes the writable bytes of a live exclusive view; preadv
        // writes at most iov_len bytes into each.
        let read = unsafe {
            libc::preadv(file.as_raw_fd(), iovecs.as_ptr(), iovecs.len() as libc::c_int, position)
        };
        if read >= 0 {
            return Ok(read as usize);
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// Reserves `len` bytes of disk for `file` (extending it), so that later writes inside cannot
/// run out of space on a file system that allocates up front. `ENOSPC`/`EFBIG` come back as is.
pub fn preallocate(file: &File, len: u64) -> io::Result<()> {
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    loop {
        // SAFETY: posix_fallocate takes a descriptor we own and two integers.
        let status = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
        match status {
            0 => return Ok(()),
            libc::EINTR => continue,
            // No preallocation on this file system (and glibc could not emulate it): size the
            // file instead; space is then taken on write, and a full disk shows there.
            libc::EOPNOTSUPP => return file.set_len(len as u64),
            errno => return Err(io::Error::from_raw_os_error(errno)),
        }
    }
}

/// Takes an exclusive advisory lock on `file` without waiting; `Ok(false)` when another open
/// file description holds it. The kernel drops it when the holder exits, however it exits.
pub fn lock_exclusive(file: &File) -> io::Result<bool> {
    loop {
        // SAFETY: flock takes a descriptor we own and flags.
        let status = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if status == 0 {
            return Ok(true);
        }
        let error = io::Error::last_os_error();
        match error.raw_os_error() {
            Some(libc::EWOULDBLOCK) => return Ok(false),
            Some(libc::EINTR) => continue,
            _ => return Err(error),
        }
    }
}

/// Releases the lock [`lock_exclusive`] took on `file`'s open file description, at once.
/// Closing the descriptor is not enough where another thread may be starting a child process:
/// between its fork and its exec the child holds a duplicate of every descriptor, and a `flock`
/// lives until the last duplicate closes.
pub fn unlock(file: &File) -> io::Result<()> {
    loop {
        // SAFETY: flock takes a descriptor we own and flags; it touches no memory of ours.
        let status = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
        if status == 0 {
            return Ok(());
        }
        let error = io::Error::last_os_error();
        if error.raw_os_error() != Some(libc::EINTR) {
            return Err(error);
        }
    }
}

/// Whether an I/O error means "no room": the file system is full, the quota spent, or the
/// process's file size limit reached.
pub fn is_no_space(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG))
}

/// The per-block failure an I/O error stands for.
pub fn failure_of(error: &io::Error) -> Failure {
    if is_no_space(error) {
        Failure::NoSpace
    } else {
        Failure::Io(error.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kvshm-dio-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("data")
    }

    #[test]
    fn aligned_buffers_are_aligned_and_rounded_up() {
        let mut buf = AlignedBuf::zeroed(5000);
        assert_eq!(buf.len(), 8192);
        assert!(is_aligned(buf.as_slice().as_ptr(), buf.len()));
        assert!(buf.as_slice().iter().all(|&b| b == 0));
        buf.as_mut_slice()[8191] = 1;
        assert!(!is_aligned(buf.as_slice()[1..].as_ptr(), 8191));
    }

    #[test]
    fn vectored_writes_and_reads_move_every_byte_in_either_mode() {
        for prefer_direct in [true, false] {
            let path = scratch(if prefer_direct { "direct" } else { "buffered" });
            let data = DataFile::open(&path, true, prefer_direct).unwrap();
            preallocate(data.file(), 4 * IO_ALIGN as u64).unwrap();
            let mut a = AlignedBuf::zeroed(IO_ALIGN);
            let mut b = AlignedBuf::zeroed(2 * IO_ALIGN);
            a.as_mut_slice().fill(1);
            b.as_mut_slice().fill(2);
            write_all_at(data.file(), &[a.bytes(), b.bytes()], IO_ALIGN as u64).unwrap();
            let mut back = AlignedBuf::zeroed(4 * IO_ALIGN);
            read_exact_at(data.file(), &mut [back.bytes_mut()], 0).unwrap();
            let bytes = back.as_slice();
            assert!(bytes[..IO_ALIGN].iter().all(|&x| x == 0));
            assert!(bytes[IO_ALIGN..2 * IO_ALIGN].iter().all(|&x| x == 1));
            assert!(bytes[2 * IO_ALIGN..].iter().all(|&x| x == 2));
            let mut beyond = AlignedBuf::zeroed(IO_ALIGN);
            let eof = read_exact_at(data.file(), &mut [beyond.bytes_mut()], 4 * IO_ALIGN as u64);
            assert_eq!(eof.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
            std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
        }
    }

    #[test]
    fn a_second_lock_on_the_same_file_is_refused() {
        let path = scratch("lock");
        let first = File::create(&path).unwrap();
        let second = File::open(&path).unwrap();
        assert!(lock_exclusive(&first).unwrap());
        assert!(!lock_exclusive(&second).unwrap());
        drop(first);
        assert!(lock_exclusive(&second).unwrap());
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn full_disk_errors_are_no_space() {
        for errno in [libc::ENOSPC, libc::EDQUOT, libc::EFBIG] {
            assert_eq!(failure_of(&io::Error::from_raw_os_error(errno)), Failure::NoSpace);
        }
        assert!(matches!(failure_of(&io::Error::from_raw_os_error(libc::EIO)), Failure::Io(_)));
    }
}
