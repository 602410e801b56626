//! Named POSIX shared-memory objects: creating, opening, unlinking, mapping.
//!
//! [`SharedMemory`] is one object under `/dev/shm` mapped read-write and shared, from a huge-page
//! boundary ([`crate::huge_pages`]): another process writes the same pages, so no plain Rust
//! reference into it is ever handed out; callers go through raw pointers, volatile copies and
//! atomics. The one kind of reference allowed into the mapping is a shared reference to a
//! [`SharedArea`] type: one made of atomics only, byte for byte.
//!
//! Creation ([`SharedMemory::create`]):
//! 1. `shm_open(O_CREAT | O_EXCL | O_RDWR, 0600)`: never adopt an object someone else made;
//! 2. `ftruncate` to the length and map it;
//! 3. back it in huge pages where the kernel gives them (`huge_pages::back_with_huge_pages`),
//!    then `posix_fallocate` all of it, so that every page is backed now (in small pages where no
//!    huge one is): a full `/dev/shm` is [`ShmError::NoSpace`] here, never a SIGBUS on first touch
//!    later; on any failure the object is unlinked again, so nothing is left behind.
//!
//! Opening ([`SharedMemory::open`]) goes through [`CheckedObject`]: the object is opened without
//! blocking or following a link, and only a regular file that our effective uid owns is mapped.
//!
//! Limitation: a process of the same user that shrinks the object with `ftruncate` while it is
//! mapped makes accesses beyond the new end fault (SIGBUS). Only the owner can do that, so it is a
//! bug of a trusted peer, not input we must survive.

use std::os::fd::{AsFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::{posix_fallocate, OFlag};
use nix::sys::mman::{shm_open, shm_unlink};
use nix::sys::stat::{fstat, Mode};
use nix::unistd::ftruncate;
use thiserror::Error;

use crate::huge_pages::{self, HugeBacking, Mapping};
use crate::inspect::{check_object_name, os_error, Access, CheckedObject, ObjectIdentity};

/// A type whose values may sit behind a shared reference in memory that other processes write.
///
/// # Safety
///
/// Implement only for a type whose every byte lies inside an atomic (no plain field, no padding)
/// and whose every bit pattern is a valid value. Then another process writing any byte at any
/// time neither changes a byte the reference promises is frozen nor makes the value invalid, and
/// every access through the reference is atomic, so none of them races. Each implementation sits
/// next to an assertion that the type's size is the sum of its atomic fields.
pub unsafe trait SharedArea {}

// SAFETY: an atomic is its own UnsafeCell, and every bit pattern is a valid integer.
unsafe impl SharedArea for crate::sync::AtomicU64 {}

/// Why a shared-memory operation failed.
#[derive(Debug, Error)]
pub enum ShmError {
    #[error("shared-memory object name {object:?} must start with '/' and hold no other '/'")]
    InvalidObjectName { object: String },
    #[error("shared-memory object {object} does not exist")]
    NotFound { object: String },
    #[error("shared-memory object {object} already exists")]
    AlreadyExists { object: String },
    #[error("not enough space in /dev/shm for {requested} bytes of {object}")]
    NoSpace { object: String, requested: u64 },
    #[error("shared-memory object {object} belongs to uid {owner}, and we run as uid {expected}: it is not ours to read or remove")]
    ForeignOwner { object: String, owner: u32, expected: u32 },
    #[error("{object} is a {kind} of uid {owner}, not a shared-memory object")]
    NotRegularFile { object: String, kind: &'static str, owner: u32 },
    #[error("shared-memory object {object} is empty")]
    Empty { object: String },
    #[error("{object} is a directory with files in it: kvshm removes only empty directories under its prefix; look inside, then remove it yourself")]
    DirectoryNotEmpty { object: String },
    #[error("a shared-memory object of {len} bytes is not supported on this machine")]
    TooLarge { len: u64 },
    #[error("{operation} of shared-memory object {object} failed: {source}")]
    Os {
        operation: &'static str,
        object: String,
        #[source]
        source: Errno,
    },
}

/// One mapped shared-memory object.
#[derive(Debug)]
pub struct SharedMemory {
    map: Mapping,
    /// Kept open so that [`is_intact`](SharedMemory::is_intact) can ask the object's size.
    fd: OwnedFd,
    object: String,
}

impl SharedMemory {
    /// Creates `object` (e.g. `/kvshm.NAME`) of `len` bytes, zero-filled, mode 0600, fully backed,
    /// in huge pages where the kernel gives them (module documentation).
    ///
    /// Fails with [`ShmError::AlreadyExists`] if it exists and [`ShmError::NoSpace`] if `/dev/shm`
    /// cannot hold it; on failure nothing is left behind.
    pub fn create(object: &str, len: usize) -> Result<SharedMemory, ShmError> {
        SharedMemory::create_reporting_huge_pages(object, len).map(|(memory, _)| memory)
    }

    /// [`create`](Self::create), and how much of the object the kernel put in huge pages.
    pub fn create_reporting_huge_pages(
        object: &str,
        len: usize,
    ) -> Result<(SharedMemory, HugeBacking), ShmError> {
        check_object_name(object)?;
        if len == 0 {
            return Err(ShmError::Empty { object: object.to_owned() });
        }
        let file_len =
            libc::off_t::try_from(len).map_err(|_| ShmError::TooLarge { len: len as u64 })?;
        let fd = shm_open(
            object,
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
            Mode::S_IRUSR | Mode::S_IWUSR,
        )
        .map_err(|errno| match errno {
            Errno::EEXIST => ShmError::AlreadyExists { object: object.to_owned() },
            errno => os_error("shm_open", object, errno),
        })?;
        let result = size_map_and_back(&fd, object, file_len, len);
        if result.is_err() {
            // Best effort: the object is ours (O_EXCL), and the caller gets the original error.
            let _ = shm_unlink(object);
        }
        result.map(|(map, huge)| (SharedMemory { map, fd, object: object.to_owned() }, huge))
    }

    /// Opens and maps an existing `object` read-write: a regular file that our effective uid
    /// owns (see [`CheckedObject`]).
    pub fn open(object: &str) -> Result<SharedMemory, ShmError> {
        SharedMemory::map(CheckedObject::open_with(object, Access::ReadWrite)?)
    }

    /// Maps an object opened read-write and checked.
    pub(crate) fn map(checked: CheckedObject) -> Result<SharedMemory, ShmError> {
        let (fd, stat, object) = checked.into_parts();
        if stat.st_size <= 0 {
            return Err(ShmError::Empty { object });
        }
        let len = usize::try_from(stat.st_size)
            .map_err(|_| ShmError::TooLarge { len: stat.st_size as u64 })?;
        let map =
            Mapping::new(fd.as_fd(), len).map_err(|errno| os_error("mmap", &object, errno))?;
        Ok(SharedMemory { map, fd, object })
    }

    /// Start of the mapping. Valid for [`len`](Self::len) bytes while `self` lives; other
    /// processes may write any byte at any time.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Never true: an empty object can be neither created nor opened.
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// Whether the object still holds every mapped byte. Another process of the same user can
    /// shrink it, and touching a mapped page past the end of the object raises SIGBUS; code that
    /// writes where it need not (a courtesy on shutdown) asks first. (A shrink between the
    /// question and the write still faults: nothing can rule that out with a shared mapping.)
    pub fn is_intact(&self) -> bool {
        fstat(&self.fd).is_ok_and(|stat| stat.st_size >= self.map.len() as libc::off_t)
    }

    /// Which file this maps (see [`ObjectIdentity`]).
    pub fn identity(&self) -> Result<ObjectIdentity, ShmError> {
        fstat(&self.fd)
            .map(|stat| ObjectIdentity { device: stat.st_dev, inode: stat.st_ino })
            .map_err(|errno| os_error("fstat", &self.object, errno))
    }

    /// The object name this maps (with the leading slash).
    pub fn object(&self) -> &str {
        &self.object
    }

    /// Bytes of this mapping that huge pages back and that are mapped in ([`huge_pages`]);
    /// 0 where none are or `/proc/self/smaps` cannot tell.
    pub fn mapped_huge_bytes(&self) -> u64 {
        huge_pages::mapped_huge_bytes(self.as_ptr()).unwrap_or(0)
    }
}

/// Removes `object` from `/dev/shm` if our effective uid owns it (another user's object is
/// [`ShmError::ForeignOwner`] and stays); mappings that exist stay valid until unmapped.
pub fn unlink(object: &str) -> Result<(), ShmError> {
    match crate::inspect::unlink_owned(object)? {
        true => Ok(()),
        false => Err(ShmError::NotFound { object: object.to_owned() }),
    }
}

/// Steps 2 and 3 of [`SharedMemory::create`].
fn size_map_and_back(
    fd: &OwnedFd,
    object: &str,
    file_len: libc::off_t,
    len: usize,
) -> Result<(Mapping, HugeBacking), ShmError> {
    let no_space = || ShmError::NoSpace { object: object.to_owned(), requested: len as u64 };
    ftruncate(fd, file_len).map_err(|errno| os_error("ftruncate", object, errno))?;
    let map = Mapping::new(fd.as_fd(), len).map_err(|errno| match errno {
        Errno::ENOMEM => no_space(),
        errno => os_error("mmap", object, errno),
    })?;
    let huge = huge_pages::back_with_huge_pages(fd.as_fd(), &map);
    posix_fallocate(fd, 0, file_len).map_err(|errno| match errno {
        Errno::ENOSPC | Errno::EFBIG => no_space(),
        errno => os_error("posix_fallocate", object, errno),
    })?;
    Ok((map, huge))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn unique_object(tag: &str) -> String {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        format!(
            "/kvshm-test-shm.{}.{}.{}",
            tag,
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        )
    }

    #[test]
    fn created_objects_are_zeroed_private_and_shared_between_mappings() {
        let object = unique_object("create");
        let created = SharedMemory::create(&object, 8192).unwrap();
        let mode = std::fs::metadata(format!("/dev/shm{object}")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let opened = SharedMemory::open(&object).unwrap();
        assert_eq!(opened.len(), 8192);
        // SAFETY: 1. both mappings are 8192 bytes long and live until the end of the test; 2. no
        // race: one thread, and no other process knows the object's unique name; 3. volatile
        // accesses, so that the two addresses of one page are each really read and written.
        unsafe {
            assert_eq!(opened.as_ptr().add(4000).read_volatile(), 0);
            created.as_ptr().add(4000).write_volatile(7);
            assert_eq!(opened.as_ptr().add(4000).read_volatile(), 7);
        }
        unlink(&object).unwrap();
    }

    #[test]
    fn creating_an_existing_object_fails() {
        let object = unique_object("exists");
        let _first = SharedMemory::create(&object, 4096).unwrap();
        assert!(matches!(SharedMemory::create(&object, 4096), Err(ShmError::AlreadyExists { .. })));
        unlink(&object).unwrap();
    }

    #[test]
    fn opening_a_missing_object_is_not_found() {
        let object = unique_object("missing");
        assert!(matches!(SharedMemory::open(&object), Err(ShmError::NotFound { .. })));
        assert!(matches!(unlink(&object), Err(ShmError::NotFound { .. })));
    }

    #[test]
    fn more_than_dev_shm_holds_is_no_space_and_leaves_nothing_behind() {
        let stat = nix::sys::statvfs::statvfs("/dev/shm").unwrap();
        // More than the whole file system, so that tmpfs refuses at once instead of filling
        // /dev/shm for a moment under the feet of other tests.
        let total = stat.blocks() as u64 * stat.fragment_size() as u64;
        let object = unique_object("full");
        let request = usize::try_from(total + (64 << 20)).unwrap();
        assert!(matches!(SharedMemory::create(&object, request), Err(ShmError::NoSpace { .. })));
        assert!(!std::path::Path::new(&format!("/dev/shm{object}")).exists());
    }

    #[test]
    fn object_names_need_one_leading_slash() {
        for bad in ["", "/", "x", "/a/b"] {
            assert!(
                matches!(SharedMemory::open(bad), Err(ShmError::InvalidObjectName { .. })),
                "{bad}"
            );
        }
    }
}
