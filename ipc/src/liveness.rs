//! Telling whether the process on the other side of a segment is still the one we knew.
//!
//! A pid alone is not an identity: after a process dies its pid can be handed to a new, unrelated
//! process. [`ProcessIdentity`] therefore pairs the pid with the process start time (field 22 of
//! `/proc/PID/stat`, clock ticks since boot), which no two processes with the same pid share.
//!
//! Flow of one check ([`ProcessIdentity::status`]):
//! 1. read `/proc/PID/stat`; a missing entry means the process is gone;
//! 2. state `Z` (zombie) or `X` (dead) counts as gone: it runs no code any more;
//! 3. a different start time means the pid was reused by another process.
//!
//! A check reads `/proc` (tens of microseconds); [`LivenessCache`] lets a caller that checks on
//! every poll do so at most every [`LIVENESS_RECHECK`] while the answer is "alive".
//!
//! [`monotonic_ns`] is the clock of heartbeats: `CLOCK_MONOTONIC` is system wide, so values written
//! by one process compare with values read by another.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use bytemuck::{Pod, Zeroable};
use nix::errno::Errno;
use nix::sys::signal::kill;
use nix::time::{clock_gettime, ClockId};
use nix::unistd::Pid;

/// A process as seen from another one: its pid and its start time.
///
/// Stored in shared memory (creator of a segment, worker of a rank), so `#[repr(C)]` and Pod.
/// The all-zero value names no process.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct ProcessIdentity {
    pub pid: u32,
    _reserved: u32,
    /// Start time in clock ticks since boot; 0 when it could not be read (only the pid is checked).
    pub start_time: u64,
}

const _: () = assert!(size_of::<ProcessIdentity>() == 16);

/// What became of a process we knew.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProcessStatus {
    /// It runs.
    Alive,
    /// No process has its pid (or the identity is the all-zero value).
    Exited,
    /// It exited and waits for its parent to reap it.
    Zombie,
    /// Its pid now belongs to another process.
    Reused,
}

impl ProcessIdentity {
    pub const fn new(pid: u32, start_time: u64) -> Self {
        Self { pid, _reserved: 0, start_time }
    }

    /// The calling process (read from `/proc` once per process; a forked child reads its own).
    pub fn current() -> Self {
        static CURRENT: Mutex<Option<ProcessIdentity>> = Mutex::new(None);
        let pid = std::process::id();
        // A panic elsewhere while holding this lock cannot leave the option half-written.
        let mut current = CURRENT.lock().unwrap_or_else(PoisonError::into_inner);
        match *current {
            Some(known) if known.pid == pid && known.start_time != 0 => known,
            _ => {
                let start_time = read_stat(pid).map_or(0, |stat| stat.start_time);
                let known = Self::new(pid, start_time);
                *current = Some(known);
                known
            }
        }
    }

    /// The process that has `pid` now, with its start time; `None` if there is none (or `/proc`
    /// cannot tell).
    pub fn of_pid(pid: u32) -> Option<Self> {
        read_stat(pid).ok().map(|stat| Self::new(pid, stat.start_time))
    }

    /// True for the all-zero value, which names no process.
    pub fn is_none(&self) -> bool {
        self.pid == 0
    }

    /// True while this very process runs (not a zombie, and its pid not reused).
    pub fn is_alive(&self) -> bool {
        self.status() == ProcessStatus::Alive
    }

    /// What became of this process.
    pub fn status(&self) -> ProcessStatus {
        if self.pid == 0 || self.pid > i32::MAX as u32 {
            return ProcessStatus::Exited;
        }
        match read_stat(self.pid) {
            Ok(stat) => {
                if stat.state == 'Z' || stat.state == 'X' || stat.state == 'x' {
                    ProcessStatus::Zombie
                } else if self.start_time != 0 && stat.start_time != self.start_time {
                    ProcessStatus::Reused
                } else {
                    ProcessStatus::Alive
                }
            }
            Err(StatError::Missing) => ProcessStatus::Exited,
            // /proc is unusable (not mounted, hidepid): fall back to the pid check alone.
            Err(StatError::Unreadable) => match kill(Pid::from_raw(self.pid as i32), None) {
                Err(Errno::ESRCH) => ProcessStatus::Exited,
                _ => ProcessStatus::Alive,
            },
        }
    }
}

/// How long [`LivenessCache`] trusts a positive answer before reading `/proc` again.
pub const LIVENESS_RECHECK: Duration = Duration::from_millis(5);

/// Remembers the last verdict on one process, so that a caller that checks on every poll reads
/// `/proc` (tens of microseconds) at most every `recheck` while the process lives. A death is
/// remembered for good: the same identity never comes back.
#[derive(Debug)]
pub struct LivenessCache {
    recheck_ns: u64,
    /// (identity checked, when, verdict).
    last: Mutex<Option<(ProcessIdentity, u64, bool)>>,
}

impl LivenessCache {
    pub const fn new(recheck: Duration) -> Self {
        LivenessCache { recheck_ns: recheck.as_nanos() as u64, last: Mutex::new(None) }
    }

    /// [`ProcessIdentity::is_alive`], answered from the cache while fresh.
    pub fn is_alive(&self, identity: ProcessIdentity) -> bool {
        let now = monotonic_ns();
        // A panic elsewhere while holding this lock cannot leave the tuple half-written.
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((known, checked_at, alive)) = *last {
            if known == identity && (!alive || now.saturating_sub(checked_at) < self.recheck_ns) {
                return alive;
            }
        }
        let alive = identity.is_alive();
        *last = Some((identity, now, alive));
        alive
    }
}

impl Default for LivenessCache {
    fn default() -> Self {
        LivenessCache::new(LIVENESS_RECHECK)
    }
}

/// Nanoseconds of `CLOCK_MONOTONIC`, the heartbeat clock shared by every process on the host.
pub fn monotonic_ns() -> u64 {
    let now = clock_gettime(ClockId::CLOCK_MONOTONIC)
        .expect("CLOCK_MONOTONIC is always available on Linux; failing is a programming error");
    (now.tv_sec() as u64).saturating_mul(1_000_000_000).saturating_add(now.tv_nsec() as u64)
}

struct Stat {
    state: char,
    start_time: u64,
}

enum StatError {
    Missing,
    Unreadable,
}

fn read_stat(pid: u32) -> Result<Stat, StatError> {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(text) => parse_stat(&text).ok_or(StatError::Unreadable),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Err(StatError::Missing),
        // ESRCH: the process went away while we read.
        Err(error) if error.raw_os_error() == Some(libc::ESRCH) => Err(StatError::Missing),
        Err(_) => Err(StatError::Unreadable),
    }
}

/// Parses `pid (comm) state ppid ... starttime ...`. The command name may hold spaces and
/// parentheses, so the fields are counted from the last ')'.
fn parse_stat(text: &str) -> Option<Stat> {
    let after_comm = &text[text.rfind(')')? + 1..];
    let mut fields = after_comm.split_ascii_whitespace();
    // Field 3 is the state; starttime is field 22, i.e. 19 fields after the state.
    let state = fields.next()?.chars().next()?;
    let start_time = fields.nth(18)?.parse().ok()?;
    Some(Stat { state, start_time })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_current_process_is_alive() {
        let me = ProcessIdentity::current();
        assert_eq!(me.pid, std::process::id());
        assert_ne!(me.start_time, 0);
        assert!(me.is_alive());
        assert_eq!(ProcessIdentity::of_pid(me.pid), Some(me));
        assert_eq!(ProcessIdentity::of_pid(2_000_000_000), None);
    }

    #[test]
    fn a_reused_pid_is_not_alive() {
        let me = ProcessIdentity::current();
        let impostor = ProcessIdentity::new(me.pid, me.start_time + 1);
        assert_eq!(impostor.status(), ProcessStatus::Reused);
    }

    #[test]
    fn the_zero_identity_names_no_process() {
        assert!(ProcessIdentity::default().is_none());
        assert_eq!(ProcessIdentity::default().status(), ProcessStatus::Exited);
    }

    #[test]
    fn an_exited_child_is_a_zombie_until_reaped_and_gone_after() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let identity =
            ProcessIdentity::new(child.id(), read_stat(child.id()).map_or(0, |s| s.start_time));
        // Wait for it to exit without reaping it.
        let mut waited = 0;
        while identity.status() == ProcessStatus::Alive && waited < 5_000 {
            std::thread::sleep(std::time::Duration::from_millis(1));
            waited += 1;
        }
        assert_eq!(identity.status(), ProcessStatus::Zombie);
        child.wait().unwrap();
        assert!(!identity.is_alive());
    }

    #[test]
    fn stat_lines_with_odd_command_names_parse() {
        let line = "42 (a) b (c) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 98765 0 0";
        let stat = parse_stat(line).unwrap();
        assert_eq!(stat.state, 'S');
        assert_eq!(stat.start_time, 98765);
        assert!(parse_stat("42 (x").is_none());
        assert!(parse_stat("42 (x) S 1").is_none());
    }

    #[test]
    fn the_cache_remembers_a_death_and_rechecks_life() {
        let cache = LivenessCache::new(Duration::ZERO);
        let me = ProcessIdentity::current();
        assert!(cache.is_alive(me));
        assert!(cache.is_alive(me));
        let ghost = ProcessIdentity::new(me.pid, me.start_time + 1);
        assert!(!cache.is_alive(ghost));
        assert!(cache.is_alive(me));
    }

    #[test]
    fn the_monotonic_clock_does_not_go_back() {
        let a = monotonic_ns();
        let b = monotonic_ns();
        assert!(b >= a && a > 0);
    }
}
