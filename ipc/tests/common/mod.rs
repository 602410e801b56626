//! Helpers shared by the segment integration tests: unique names, cleanup, forged segment files,
//! and child processes (the test binary re-executing itself with an environment variable).
// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvshm_ipc::layout::HeaderFields;
use kvshm_ipc::listing::{self, SHM_DIR};
use kvshm_ipc::liveness::ProcessIdentity;
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::segment::Segment;

/// The environment variable that turns a test binary into a child helper.
pub const CHILD_ROLE: &str = "KVSHM_TEST_CHILD_ROLE";
/// The segment name handed to a child.
pub const CHILD_SEGMENT: &str = "KVSHM_TEST_CHILD_SEGMENT";

/// A segment name unique to this process and call.
pub fn unique_name(tag: &str) -> SegmentName {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let name =
        format!("t-{tag}-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
    SegmentName::new(&name).expect("test names are valid")
}

/// Removes every object of a name when dropped (also when the test fails), whoever owns it: a
/// test may have given one to another uid, which `listing::unlink` rightly refuses to remove.
pub struct Cleanup(pub SegmentName);

impl Drop for Cleanup {
    fn drop(&mut self) {
        remove_every_object(&self.0);
    }
}

/// Removes every file under /dev/shm that belongs to segment `name`, without asking who owns it.
pub fn remove_every_object(name: &SegmentName) {
    let Ok(entries) = std::fs::read_dir(SHM_DIR) else { return };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let parsed = file_name.to_str().and_then(kvshm_ipc::name::ObjectName::parse);
        if parsed.is_some_and(|parsed| &parsed.segment == name) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The path of an object under /dev/shm.
pub fn shm_path(object: &str) -> String {
    format!("{SHM_DIR}{object}")
}

/// The bytes of a freshly created segment named `name` (the segment itself is removed).
pub fn segment_bytes(name: &SegmentName) -> Vec<u8> {
    let segment = Segment::create(name, &Default::default()).expect("create");
    let bytes = std::fs::read(shm_path(&name.control_object())).expect("read segment");
    drop(segment);
    let _ = listing::unlink(name);
    bytes
}

/// Writes `bytes` as the control object of `name`, mode 0600.
pub fn write_control(name: &SegmentName, bytes: &[u8]) {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(shm_path(&name.control_object()))
        .expect("forge control object");
    std::io::Write::write_all(&mut file, bytes).expect("write control object");
}

/// A copy of a real segment's bytes with the header fields changed by `edit`, written as `name`.
pub fn forge(name: &SegmentName, edit: impl FnOnce(&mut HeaderFields)) -> Vec<u8> {
    let mut bytes = segment_bytes(name);
    let size = size_of::<HeaderFields>();
    let mut fields: HeaderFields = bytemuck::pod_read_unaligned(&bytes[..size]);
    edit(&mut fields);
    bytes[..size].copy_from_slice(bytemuck::bytes_of(&fields));
    write_control(name, &bytes);
    bytes
}

/// Byte offset of the ready flag in the header.
pub const READY_OFFSET: usize = 288;

/// Sets the ready word of a byte image.
pub fn set_ready(bytes: &mut [u8], value: u32) {
    bytes[READY_OFFSET..READY_OFFSET + 4].copy_from_slice(&value.to_le_bytes());
}

/// The identity of a process that existed and is gone (spawned, exited, reaped).
pub fn dead_identity() -> ProcessIdentity {
    let mut child = Command::new("true").spawn().expect("spawn true");
    let pid = child.id();
    child.wait().expect("reap true");
    ProcessIdentity::new(pid, 1)
}

/// A child process running this test binary in `role` on segment `name`, with a reader of its
/// stdout.
pub struct ChildProcess {
    pub child: Child,
    stdout: BufReader<ChildStdout>,
}

impl ChildProcess {
    /// Spawns the test `entry` of this binary with the child role set.
    pub fn spawn(entry: &str, role: &str, name: &SegmentName) -> ChildProcess {
        let mut child = Command::new(std::env::current_exe().expect("test binary path"))
            .args([entry, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ROLE, role)
            .env(CHILD_SEGMENT, name.as_str())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn child");
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        ChildProcess { child, stdout }
    }

    /// Reads the child's stdout until a line ending in `marker`; panics if it ends first.
    pub fn wait_for_line(&mut self, marker: &str) {
        let mut line = String::new();
        loop {
            line.clear();
            let read = self.stdout.read_line(&mut line).expect("read child stdout");
            assert_ne!(read, 0, "child exited before printing {marker:?}");
            // The test harness prints "test NAME ... " without a newline before our output.
            if line.trim_end().ends_with(marker) {
                return;
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid() as i32), signal)
            .expect("signal child");
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `condition` every 100 µs until it holds or `limit` passes; returns the time it took.
pub fn time_until(limit: Duration, mut condition: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if condition() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    None
}
