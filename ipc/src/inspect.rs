//! Looking at objects under `/dev/shm` without trusting them: opening, describing and removing.
//!
//! `/dev/shm` is writable by every local user, so a name under our prefix may be a FIFO (whose
//! plain `open` blocks forever), a symbolic link to anywhere, a directory, or a regular file that
//! another user planted there. Every kvshm process (scheduler, worker, kvctl), root included,
//! goes through this module before it reads, maps or removes an object:
//!
//! - [`CheckedObject::open`] opens with `O_NONBLOCK | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC`, then
//!   checks on the opened descriptor (`fstat`, not a second look at the path) that it is a regular
//!   file owned by our effective uid. Only then are bytes read ([`CheckedObject::read_at`], which
//!   never maps) or the object mapped (`SharedMemory`).
//! - [`status`] describes an object without opening it (`lstat`): kind, owner, size, age, identity.
//! - [`unlink_owned`] removes an object only if our effective uid owns it, and
//!   [`unlink_if_identical`] only if it is still the very file a creator made ([`ObjectIdentity`]:
//!   device and inode, which the creator remembers in its own memory, where no peer can scribble).
//!
//! Flow of one checked open: 1. open the name with the flags above (a link fails with `ELOOP`, a
//! FIFO opens at once); 2. on failure, `lstat` the name to say what is there instead (kind,
//! owner); 3. `fstat` the descriptor: not a regular file is [`ShmError::NotRegularFile`], another
//! owner is [`ShmError::ForeignOwner`], both naming the object and its owner.
//!
//! Limitation: removal is by name, so a check and the unlink that follows are two steps. In the
//! sticky `/dev/shm` only the owner (or root) can remove a file, so another user cannot swap one
//! of ours for one of theirs in between; only our own processes (or root) could.

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::time::{Duration, SystemTime};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::mman::{shm_open, shm_unlink};
use nix::sys::stat::{fstat, lstat, FileStat, Mode, SFlag};
use nix::unistd::geteuid;

use crate::shm::ShmError;

/// Where POSIX shared-memory objects appear on Linux.
pub const SHM_DIR: &str = "/dev/shm";

/// Which file, as opposed to which name: a creator remembers this of what it made, so that it
/// removes its own objects on drop and never one that replaced them.
///
/// While any process holds the file open or mapped, no other file can have the same identity;
/// after the last close tmpfs hands out inode numbers in increasing order, so a recreated name
/// gets another identity unless some four billion objects were made in between.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ObjectIdentity {
    pub device: u64,
    pub inode: u64,
}

impl ObjectIdentity {
    fn of(stat: &FileStat) -> ObjectIdentity {
        ObjectIdentity { device: stat.st_dev, inode: stat.st_ino }
    }
}

/// What lies under a name, as `lstat` sees it (the name is not opened).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectStatus {
    /// `"regular file"`, `"fifo"`, `"symbolic link"`, ...
    pub kind: &'static str,
    pub owner: u32,
    pub len: u64,
    pub modified: Option<SystemTime>,
    pub identity: ObjectIdentity,
}

impl ObjectStatus {
    fn of(stat: &FileStat) -> ObjectStatus {
        ObjectStatus {
            kind: kind_name(stat.st_mode),
            owner: stat.st_uid,
            len: u64::try_from(stat.st_size).unwrap_or(0),
            modified: modified(stat),
            identity: ObjectIdentity::of(stat),
        }
    }

    pub fn is_regular_file(&self) -> bool {
        self.kind == REGULAR_FILE
    }

    /// True when the object was last modified at least `age` ago (false if that cannot be told).
    pub fn unchanged_for(&self, age: Duration) -> bool {
        unchanged_for(self.modified, age)
    }
}

/// Our effective uid: the owner every object we read, map or remove must have.
pub fn our_uid() -> u32 {
    geteuid().as_raw()
}

/// The file-system path of object `object` (`/kvshm.NAME` -> `/dev/shm/kvshm.NAME`).
pub fn object_path(object: &str) -> String {
    format!("{SHM_DIR}{object}")
}

/// Describes `object` (a name with its leading slash) without opening it.
pub fn status(object: &str) -> Result<ObjectStatus, ShmError> {
    check_object_name(object)?;
    match lstat(object_path(object).as_str()) {
        Ok(stat) => Ok(ObjectStatus::of(&stat)),
        Err(Errno::ENOENT) => Err(ShmError::NotFound { object: object.to_owned() }),
        Err(errno) => Err(os_error("lstat", object, errno)),
    }
}

/// An object opened and checked: a regular file that our effective uid owns. Reading it never
/// blocks and never maps it.
#[derive(Debug)]
pub struct CheckedObject {
    file: File,
    stat: FileStat,
    object: String,
}

/// How a [`CheckedObject`] is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    ReadOnly,
    ReadWrite,
}

impl CheckedObject {
    /// Opens `object` read-only and checks it (module flow).
    pub fn open(object: &str) -> Result<CheckedObject, ShmError> {
        CheckedObject::open_with(object, Access::ReadOnly)
    }

    /// Opens `object` with `access` and checks it (module flow).
    pub fn open_with(object: &str, access: Access) -> Result<CheckedObject, ShmError> {
        check_object_name(object)?;
        let mode = match access {
            Access::ReadOnly => OFlag::O_RDONLY,
            Access::ReadWrite => OFlag::O_RDWR,
        };
        let flags = mode | OFlag::O_NONBLOCK | OFlag::O_NOFOLLOW | OFlag::O_NOCTTY;
        // glibc's shm_open adds O_CLOEXEC (and O_NOFOLLOW) itself.
        let fd: OwnedFd = shm_open(object, flags, Mode::empty())
            .map_err(|errno| explain_open_failure(object, errno))?;
        let stat = fstat(&fd).map_err(|errno| os_error("fstat", object, errno))?;
        check_checked(object, &stat)?;
        Ok(CheckedObject { file: File::from(fd), stat, object: object.to_owned() })
    }

    /// Bytes of the object when it was opened.
    pub fn len(&self) -> u64 {
        u64::try_from(self.stat.st_size).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn modified(&self) -> Option<SystemTime> {
        modified(&self.stat)
    }

    /// True when the object was last modified at least `age` ago (false if that cannot be told).
    pub fn unchanged_for(&self, age: Duration) -> bool {
        unchanged_for(self.modified(), age)
    }

    pub fn identity(&self) -> ObjectIdentity {
        ObjectIdentity::of(&self.stat)
    }

    /// The object name, with its leading slash.
    pub fn object(&self) -> &str {
        &self.object
    }

    /// Reads up to `len` bytes from `offset` (fewer at the end of the object).
    pub fn read_at(&self, offset: u64, len: usize) -> Result<Vec<u8>, ShmError> {
        let mut bytes = vec![0u8; len];
        let mut filled = 0;
        while filled < len {
            match self.file.read_at(&mut bytes[filled..], offset + filled as u64) {
                Ok(0) => break,
                Ok(read) => filled += read,
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error) => return Err(os_error("pread", &self.object, io_errno(&error))),
            }
        }
        bytes.truncate(filled);
        Ok(bytes)
    }

    pub(crate) fn into_parts(self) -> (OwnedFd, FileStat, String) {
        (OwnedFd::from(self.file), self.stat, self.object)
    }
}

/// Removes `object` if our effective uid owns it (whatever it is: a FIFO or link of ours is
/// garbage too). Returns `false` if it was not there; another user's object is
/// [`ShmError::ForeignOwner`] and stays.
pub fn unlink_owned(object: &str) -> Result<bool, ShmError> {
    let status = match status(object) {
        Ok(status) => status,
        Err(ShmError::NotFound { .. }) => return Ok(false),
        Err(error) => return Err(error),
    };
    if status.owner != our_uid() {
        return Err(foreign(object, status.owner));
    }
    unlink_name(object)
}

/// Removes `object` if it is still the file `identity` names; returns whether it did.
pub fn unlink_if_identical(object: &str, identity: ObjectIdentity) -> Result<bool, ShmError> {
    match status(object) {
        Ok(status) if status.identity == identity => unlink_name(object),
        Ok(_) | Err(ShmError::NotFound { .. }) => Ok(false),
        Err(error) => Err(error),
    }
}

/// Removes the name `object`: `shm_unlink`, or for a directory (garbage under our prefix too)
/// `rmdir`, which removes only an empty one ([`ShmError::DirectoryNotEmpty`] otherwise).
fn unlink_name(object: &str) -> Result<bool, ShmError> {
    match shm_unlink(object) {
        Ok(()) => Ok(true),
        Err(Errno::ENOENT) => Ok(false),
        Err(Errno::EISDIR) => match std::fs::remove_dir(object_path(object)) {
            Ok(()) => Ok(true),
            Err(error) => match io_errno(&error) {
                Errno::ENOENT => Ok(false),
                Errno::ENOTEMPTY | Errno::EEXIST => {
                    Err(ShmError::DirectoryNotEmpty { object: object.to_owned() })
                }
                errno => Err(os_error("rmdir", object, errno)),
            },
        },
        Err(errno) => Err(os_error("shm_unlink", object, errno)),
    }
}

/// Whether `object` is a directory with entries in it (which [`unlink_owned`] does not remove).
pub fn is_directory_with_entries(object: &str) -> bool {
    std::fs::read_dir(object_path(object)).is_ok_and(|mut entries| entries.next().is_some())
}

/// The checks of [`CheckedObject::open`] on the descriptor's `fstat`.
fn check_checked(object: &str, stat: &FileStat) -> Result<(), ShmError> {
    if kind_name(stat.st_mode) != REGULAR_FILE {
        return Err(ShmError::NotRegularFile {
            object: object.to_owned(),
            kind: kind_name(stat.st_mode),
            owner: stat.st_uid,
        });
    }
    if stat.st_uid != our_uid() {
        return Err(foreign(object, stat.st_uid));
    }
    Ok(())
}

/// Says what lies under `object` when opening it failed: a link (`ELOOP`), a directory
/// (`EISDIR`), a socket (`ENXIO`), someone else's file (`EACCES`).
fn explain_open_failure(object: &str, errno: Errno) -> ShmError {
    if errno == Errno::ENOENT {
        return ShmError::NotFound { object: object.to_owned() };
    }
    match status(object) {
        Ok(status) if !status.is_regular_file() => ShmError::NotRegularFile {
            object: object.to_owned(),
            kind: status.kind,
            owner: status.owner,
        },
        Ok(status) if status.owner != our_uid() => foreign(object, status.owner),
        _ => os_error("shm_open", object, errno),
    }
}

fn foreign(object: &str, owner: u32) -> ShmError {
    ShmError::ForeignOwner { object: object.to_owned(), owner, expected: our_uid() }
}

const REGULAR_FILE: &str = "regular file";

fn kind_name(mode: libc::mode_t) -> &'static str {
    match SFlag::from_bits_truncate(mode & SFlag::S_IFMT.bits()) {
        SFlag::S_IFREG => REGULAR_FILE,
        SFlag::S_IFIFO => "fifo",
        SFlag::S_IFLNK => "symbolic link",
        SFlag::S_IFDIR => "directory",
        SFlag::S_IFSOCK => "socket",
        SFlag::S_IFCHR => "character device",
        SFlag::S_IFBLK => "block device",
        _ => "file of unknown kind",
    }
}

fn modified(stat: &FileStat) -> Option<SystemTime> {
    let seconds = u64::try_from(stat.st_mtime).ok()?;
    let nanos = u32::try_from(stat.st_mtime_nsec).ok()?;
    SystemTime::UNIX_EPOCH.checked_add(Duration::new(seconds, nanos.min(999_999_999)))
}

fn unchanged_for(modified: Option<SystemTime>, age: Duration) -> bool {
    modified
        .and_then(|modified| SystemTime::now().duration_since(modified).ok())
        .is_some_and(|elapsed| elapsed >= age)
}

pub(crate) fn check_object_name(object: &str) -> Result<(), ShmError> {
    let valid = object.len() > 1
        && object.starts_with('/')
        && !object[1..].contains('/')
        && !object.contains('\0');
    if valid {
        Ok(())
    } else {
        Err(ShmError::InvalidObjectName { object: object.to_owned() })
    }
}

pub(crate) fn os_error(operation: &'static str, object: &str, source: Errno) -> ShmError {
    ShmError::Os { operation, object: object.to_owned(), source }
}

pub(crate) fn io_errno(error: &std::io::Error) -> Errno {
    error.raw_os_error().map_or(Errno::UnknownErrno, Errno::from_raw)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn unique_object(tag: &str) -> String {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        format!(
            "/kvshm-test-inspect.{tag}.{}.{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        )
    }

    #[test]
    fn a_fifo_opens_at_once_and_is_refused_as_not_a_regular_file() {
        let object = unique_object("fifo");
        nix::unistd::mkfifo(object_path(&object).as_str(), Mode::S_IRUSR | Mode::S_IWUSR).unwrap();
        for access in [Access::ReadOnly, Access::ReadWrite] {
            let error = CheckedObject::open_with(&object, access).unwrap_err();
            assert!(matches!(error, ShmError::NotRegularFile { kind: "fifo", .. }), "{error:?}");
        }
        assert_eq!(status(&object).unwrap().kind, "fifo");
        assert!(unlink_owned(&object).unwrap());
        assert!(!unlink_owned(&object).unwrap());
    }

    #[test]
    fn a_link_and_a_directory_are_named_for_what_they_are() {
        let link = unique_object("link");
        std::os::unix::fs::symlink("/etc/hostname", object_path(&link)).unwrap();
        let error = CheckedObject::open(&link).unwrap_err();
        assert!(matches!(error, ShmError::NotRegularFile { kind: "symbolic link", .. }), "{error}");
        assert!(error.to_string().contains(&link), "{error}");
        unlink_owned(&link).unwrap();
        assert!(std::path::Path::new("/etc/hostname").exists());

        let directory = unique_object("dir");
        std::fs::create_dir(object_path(&directory)).unwrap();
        let error = CheckedObject::open_with(&directory, Access::ReadWrite).unwrap_err();
        assert!(matches!(error, ShmError::NotRegularFile { kind: "directory", .. }), "{error}");
        std::fs::remove_dir(object_path(&directory)).unwrap();
    }

    #[test]
    fn a_regular_object_of_ours_reads_by_offset_and_knows_its_identity() {
        let object = unique_object("file");
        std::fs::write(object_path(&object), b"0123456789").unwrap();
        let checked = CheckedObject::open(&object).unwrap();
        assert_eq!(checked.len(), 10);
        assert_eq!(checked.read_at(4, 3).unwrap(), b"456");
        assert_eq!(checked.read_at(8, 100).unwrap(), b"89");
        assert_eq!(checked.identity(), status(&object).unwrap().identity);
        assert!(!checked.unchanged_for(Duration::from_secs(3600)));

        // Another file under the same name is another identity, and is left alone.
        let identity = checked.identity();
        drop(checked);
        std::fs::remove_file(object_path(&object)).unwrap();
        std::fs::write(object_path(&object), b"new").unwrap();
        assert!(!unlink_if_identical(&object, identity).unwrap());
        let identity = status(&object).unwrap().identity;
        assert!(unlink_if_identical(&object, identity).unwrap());
    }

    #[test]
    fn missing_objects_are_not_found() {
        let object = unique_object("missing");
        assert!(matches!(CheckedObject::open(&object), Err(ShmError::NotFound { .. })));
        assert!(matches!(status(&object), Err(ShmError::NotFound { .. })));
    }
}
