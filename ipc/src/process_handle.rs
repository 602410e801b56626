//! A handle on one process, taken when the scheduler saw it attach, so that liveness checks and
//! signals reach exactly that process and never whatever holds its pid later.
//!
//! [`ProcessHandle::open`]:
//! 1. `pidfd_open(pid)`: a descriptor for the process that holds the pid now;
//! 2. read the pid's start time from `/proc` again: if it is the identity's, the descriptor names
//!    the process that attached (a process that reused the pid before step 1 started later).
//!
//! [`ProcessHandle::is_alive`] polls the descriptor (it turns readable once the process exited,
//! zombie or reaped); [`ProcessHandle::kill`] is `pidfd_send_signal(SIGKILL)`.
//!
//! Without pidfds (Linux before 5.3 answers ENOSYS; a seccomp filter may answer EPERM) a handle
//! keeps the identity alone: liveness reads `/proc` (pid and start time) and `kill` re-checks the
//! start time just before `kill(2)`, which a pid reused in that instant could still reach.
//! [`ProcessHandle::has_pidfd`] says which kind a handle is, and the first handle without a pidfd
//! logs a warning.
//!
//! [`maps_object`] tells whether a process maps a given file: the proof that a pid found in a
//! worker slot belongs to a process attached to the segment and not to an unrelated one.

use std::io::{BufRead, BufReader};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Once;

use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use thiserror::Error;

use crate::liveness::{ProcessIdentity, ProcessStatus};

/// A file, as `/proc/PID/maps` names it: device and inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ObjectId {
    pub dev: u64,
    pub ino: u64,
}

/// Why no handle could be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum OpenError {
    /// The process exited, or its pid now names a process that started at another time.
    #[error("process {pid} is gone")]
    Gone { pid: u32 },
    #[error("pidfd_open({pid}) failed: {errno}")]
    Os { pid: u32, errno: Errno },
}

/// One process, as it was when the handle was opened (module documentation).
#[derive(Debug)]
pub struct ProcessHandle {
    identity: ProcessIdentity,
    /// `None` where the kernel offers no pidfds.
    pidfd: Option<OwnedFd>,
}

static NO_PIDFD_WARNING: Once = Once::new();

impl ProcessHandle {
    /// Opens a handle on the process `identity` names. A start time of 0 (a process that could
    /// not read its own from `/proc`) leaves the pid alone to name it, with a warning.
    pub fn open(identity: ProcessIdentity) -> Result<ProcessHandle, OpenError> {
        let pid = identity.pid;
        if pid == 0 || pid > i32::MAX as u32 {
            return Err(OpenError::Gone { pid });
        }
        if identity.start_time == 0 {
            tracing::warn!(pid, "a worker without a start time is known by its pid alone");
        }
        let pidfd = match pidfd_open(pid) {
            Ok(fd) => Some(fd),
            Err(Errno::ESRCH) => return Err(OpenError::Gone { pid }),
            Err(Errno::ENOSYS | Errno::EPERM) => {
                NO_PIDFD_WARNING.call_once(|| {
                    tracing::warn!(
                        "this kernel offers no pidfds: workers are fenced by pid after checking \
                         their start time, which a pid reused in that instant could defeat"
                    )
                });
                None
            }
            Err(errno) => return Err(OpenError::Os { pid, errno }),
        };
        // Step 2: the pid still names the process that started at identity.start_time.
        if identity.status() != ProcessStatus::Alive {
            return Err(OpenError::Gone { pid });
        }
        Ok(ProcessHandle { identity, pidfd })
    }

    pub fn identity(&self) -> ProcessIdentity {
        self.identity
    }

    pub fn has_pidfd(&self) -> bool {
        self.pidfd.is_some()
    }

    /// Whether the process still runs (a zombie does not).
    pub fn is_alive(&self) -> bool {
        match &self.pidfd {
            Some(fd) => !pidfd_exited(fd),
            None => self.identity.is_alive(),
        }
    }

    /// Sends SIGKILL to the process. Killing a process that already exited is no error.
    pub fn kill(&self) -> Result<(), Errno> {
        match &self.pidfd {
            Some(fd) => match pidfd_send_signal(fd, Signal::SIGKILL) {
                Err(Errno::ESRCH) | Ok(()) => Ok(()),
                Err(errno) => Err(errno),
            },
            None => {
                if !self.identity.is_alive() {
                    return Ok(());
                }
                match kill(Pid::from_raw(self.identity.pid as i32), Signal::SIGKILL) {
                    Err(Errno::ESRCH) | Ok(()) => Ok(()),
                    Err(errno) => Err(errno),
                }
            }
        }
    }
}

fn pidfd_open(pid: u32) -> Result<OwnedFd, Errno> {
    // SAFETY: pidfd_open takes a pid and a flags word and returns a new descriptor or -1; it
    // touches no memory of this process.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0 as libc::c_uint) };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
}

fn pidfd_send_signal(fd: &OwnedFd, signal: Signal) -> Result<(), Errno> {
    // SAFETY: a null siginfo pointer is allowed (the kernel fills in what kill(2) would); the
    // call reads no other memory of this process.
    let result = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            signal as libc::c_int,
            std::ptr::null::<libc::siginfo_t>(),
            0 as libc::c_uint,
        )
    };
    if result < 0 {
        Err(Errno::last())
    } else {
        Ok(())
    }
}

/// Whether the process behind `fd` exited: a pidfd polls readable from then on.
fn pidfd_exited(fd: &OwnedFd) -> bool {
    let mut entry = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: `entry` is one valid pollfd that lives across the call; timeout 0 never blocks.
    let ready = unsafe { libc::poll(&mut entry, 1, 0) };
    ready > 0 && entry.revents & (libc::POLLIN | libc::POLLHUP) != 0
}

/// Whether process `pid` has `object` mapped, from `/proc/PID/maps`.
///
/// # Errors
///
/// `/proc/PID/maps` cannot be read: the process is gone (NotFound) or hidden from us.
pub fn maps_object(pid: u32, object: ObjectId) -> std::io::Result<bool> {
    let file = std::fs::File::open(format!("/proc/{pid}/maps"))?;
    for line in BufReader::new(file).lines() {
        if maps_line_names(&line?, object) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Parses `start-end perms offset major:minor inode [path]` (major and minor in hex).
fn maps_line_names(line: &str, object: ObjectId) -> bool {
    let mut fields = line.split_ascii_whitespace().skip(3);
    let (Some(device), Some(inode)) = (fields.next(), fields.next()) else { return false };
    let Some((major, minor)) = device.split_once(':') else { return false };
    let parsed =
        (u64::from_str_radix(major, 16), u64::from_str_radix(minor, 16), inode.parse::<u64>());
    let (Ok(major), Ok(minor), Ok(inode)) = parsed else { return false };
    inode == object.ino
        && major == nix::sys::stat::major(object.dev)
        && minor == nix::sys::stat::minor(object.dev)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;
    use std::process::{Command, Stdio};

    use super::*;

    fn object_of(path: &str) -> ObjectId {
        let meta = std::fs::metadata(path).unwrap();
        ObjectId { dev: meta.dev(), ino: meta.ino() }
    }

    fn identity_of(child: &std::process::Child) -> ProcessIdentity {
        ProcessIdentity::of_pid(child.id()).expect("the child runs")
    }

    #[test]
    fn a_handle_follows_its_process_to_its_end_and_kills_it() {
        let mut child =
            Command::new("sleep").arg("60").stdout(Stdio::null()).spawn().expect("spawning sleep");
        let handle = ProcessHandle::open(identity_of(&child)).unwrap();
        assert!(handle.has_pidfd(), "this kernel has pidfds");
        assert!(handle.is_alive());
        handle.kill().unwrap();
        let status = child.wait().unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9));
        assert!(!handle.is_alive());
        handle.kill().expect("killing an exited process is no error");
    }

    #[test]
    fn a_handle_on_a_pid_with_another_start_time_is_refused() {
        let mut child =
            Command::new("sleep").arg("60").stdout(Stdio::null()).spawn().expect("spawning sleep");
        let real = identity_of(&child);
        let impostor = ProcessIdentity::new(real.pid, real.start_time + 1);
        assert_eq!(ProcessHandle::open(impostor).unwrap_err(), OpenError::Gone { pid: real.pid });
        assert!(ProcessHandle::open(ProcessIdentity::new(real.pid, 0)).is_ok(), "the pid alone");
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(matches!(ProcessHandle::open(real), Err(OpenError::Gone { .. })));
    }

    #[test]
    fn only_a_process_that_maps_a_file_is_said_to_map_it() {
        let path = format!("/dev/shm/kvshm-test-maps.{}", std::process::id());
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        let object = object_of(&path);
        let me = std::process::id();
        assert!(!maps_object(me, object).unwrap());
        let map = memmap2::MmapOptions::new().len(4096).map_raw(&file).unwrap();
        assert!(maps_object(me, object).unwrap());
        drop(map);
        std::fs::remove_file(&path).unwrap();
        assert!(maps_object(2_000_000_000, object).is_err(), "no such process");
    }

    #[test]
    fn maps_lines_are_parsed_by_device_and_inode() {
        let object = ObjectId { dev: nix::sys::stat::makedev(0, 0x1a), ino: 4242 };
        assert!(maps_line_names("7f00-7f01 rw-s 00000000 00:1a 4242 /dev/shm/kvshm.x", object));
        assert!(maps_line_names("7f00-7f01 rw-s 00000000 00:1a 4242 /x (deleted)", object));
        assert!(!maps_line_names("7f00-7f01 rw-s 00000000 00:1b 4242 /dev/shm/kvshm.x", object));
        assert!(!maps_line_names("7f00-7f01 r--p 00000000 00:00 0", object));
        assert!(!maps_line_names("garbage", object));
    }
}
