//! Real `kvshm worker` processes whose stderr the test reads ([`Worker`]: the worker tests, and
//! those with a storage tier), and the scheduler's side of their rank ([`RankDriver`]: the
//! shared [`RingDriver`] with the rank's tiers and the storage commands).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvshm_ipc::arena::{Arena, ArenaKind};
use kvshm_ipc::config::SegmentConfig;
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::record::{CommandHeader, Completion, Op};
use kvshm_ipc::segment::Segment;
use kvshm_ipc::storage_record::{
    encode_storage_command, storage_pair_count, StorageEntry, StorageResults,
};
use kvshm_ipc::worker_slot::RankStatus;

use super::blocks::block_content;
use super::ring_driver::RingDriver;

/// Generous bound for anything the worker tests wait for; reaching it is a failure.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// A spawned `kvshm worker`; SIGKILLed and reaped if still running when dropped.
pub struct Worker {
    pub child: Child,
}

impl Worker {
    /// Spawns `kvshm worker --name NAME --rank RANK ARGS...` with `env`; `fsize_limit` sets
    /// RLIMIT_FSIZE in the child (a disk that is "full" beyond that many bytes of any file).
    pub fn spawn(
        name: &SegmentName,
        rank: u32,
        args: &[String],
        env: &[(&str, String)],
        fsize_limit: Option<u64>,
    ) -> Worker {
        use std::os::unix::process::CommandExt;
        let mut command = Command::new(env!("CARGO_BIN_EXE_kvshm"));
        command
            .args(["worker", "--name", name.as_str(), "--rank", &rank.to_string()])
            .args(args)
            .env_remove("KVSHM_STORAGE_CRASH")
            .env_remove("KVSHM_WORKER_LAYER_DELAY_US")
            .env_remove("KVSHM_WORKER_COPY_RATE")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (key, value) in env {
            command.env(key, value);
        }
        if let Some(bytes) = fsize_limit {
            // SAFETY: between fork and exec the closure calls only setrlimit, which is
            // async-signal-safe, on a struct on its own stack.
            unsafe {
                command.pre_exec(move || {
                    let limit = libc::rlimit { rlim_cur: bytes, rlim_max: bytes };
                    if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                })
            };
        }
        Worker { child: command.spawn().expect("spawning kvshm worker") }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the exit (at most [`PATIENCE`]); the status and everything on stderr.
    pub fn wait_exit(&mut self) -> (std::process::ExitStatus, String) {
        self.wait_exit_within(PATIENCE)
    }

    /// Waits for the exit (at most `patience`); the status and everything on stderr.
    pub fn wait_exit_within(&mut self, patience: Duration) -> (std::process::ExitStatus, String) {
        use std::io::Read;
        let deadline = Instant::now() + patience;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "worker pid {} did not exit", self.pid());
            std::thread::sleep(Duration::from_millis(5));
        };
        let mut stderr = String::new();
        if let Some(mut pipe) = self.child.stderr.take() {
            pipe.read_to_string(&mut stderr).unwrap();
        }
        (status, stderr)
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(self.pid() as i32);
        nix::sys::signal::kill(pid, signal).unwrap();
    }

    /// SIGKILL and reap.
    pub fn kill_hard(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for a clean exit.
    pub fn stop(&mut self) {
        self.signal(nix::sys::signal::Signal::SIGTERM);
        let (status, stderr) = self.wait_exit();
        assert!(status.success(), "worker did not stop cleanly: {stderr}");
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            self.kill_hard();
        }
    }
}

/// The scheduler's side of one rank ([`RingDriver`]), with the rank's tiers and the storage
/// commands.
pub struct RankDriver<'a> {
    pub ring: RingDriver<'a>,
    pub host: Arena,
    pub device: Arena,
}

impl<'a> std::ops::Deref for RankDriver<'a> {
    type Target = RingDriver<'a>;
    fn deref(&self) -> &RingDriver<'a> {
        &self.ring
    }
}

impl std::ops::DerefMut for RankDriver<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.ring
    }
}

impl<'a> RankDriver<'a> {
    pub fn new(segment: &'a Segment, rank: u32) -> RankDriver<'a> {
        RankDriver {
            ring: RingDriver::new(segment, rank),
            host: segment.open_arena(ArenaKind::Host, rank).unwrap(),
            device: segment.open_arena(ArenaKind::Device, rank).unwrap(),
        }
    }

    fn block_bytes(&self) -> usize {
        self.segment.config().block_bytes() as usize
    }

    /// Sends a storage command; returns its header.
    pub fn send_storage(&mut self, op: Op, entries: &[StorageEntry]) -> CommandHeader {
        let header = self.header(op, storage_pair_count(entries.len()));
        let mut slots = Vec::new();
        encode_storage_command(&header, entries, &mut slots);
        self.send_slots(&slots);
        header
    }

    /// Sends a copy or a FLUSH/PING; returns its header.
    pub fn send_copy(&mut self, op: Op, pairs: &[(u32, u32)]) -> CommandHeader {
        let command = self.ring.copy(op, pairs);
        self.ring.send([&command]);
        command.0
    }

    /// Sends one storage command and waits for its completion, which must be OK; its results.
    pub fn storage(&mut self, op: Op, entries: &[StorageEntry]) -> StorageResults {
        let completion = self.storage_completion(op, entries);
        assert!(completion.is_ok(), "{op:?} failed: {completion:?}");
        StorageResults::from_detail(completion.detail)
    }

    /// Sends one storage command and waits for its answer, failed or not.
    pub fn storage_completion(&mut self, op: Op, entries: &[StorageEntry]) -> Completion {
        let header = self.send_storage(op, entries);
        let completion = self.completions(1)[0];
        assert_eq!(completion.command_id, header.command_id);
        completion
    }

    pub fn wait_alive(&self, worker: &Worker) {
        self.ring.wait_alive(worker.pid());
    }

    /// Plays the scheduler after a worker died: once the rank's worker is judged dead, reclaims
    /// the rank from exactly the judged owner word (nothing to do when the slot is empty: the
    /// worker released it on a clean exit).
    pub fn reclaim_after_kill(&self) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let verdict = self.segment.rank_verdict(self.rank).unwrap();
            match verdict.status {
                RankStatus::Empty => return,
                RankStatus::Dead { .. } => {
                    if self.segment.reclaim_rank(self.rank, verdict.word).is_ok() {
                        return;
                    }
                }
                RankStatus::Alive { .. } => {}
            }
            assert!(Instant::now() < deadline, "rank {} never became reclaimable", self.rank);
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn host_block_ptr(&self, block: u32) -> *mut u8 {
        let offset = block as usize * self.block_bytes();
        assert!(offset + self.block_bytes() <= self.host.data_len());
        // SAFETY: in bounds (asserted above).
        unsafe { self.host.data_ptr().add(offset) }
    }

    /// Fills host block `block` with the bytes of `tag` on this rank.
    pub fn fill_host(&self, block: u32, tag: u64) {
        let bytes = block_content(tag, self.rank, self.block_bytes());
        // SAFETY: in bounds; no command touching this block is in flight while the test writes.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.host_block_ptr(block), bytes.len())
        };
    }

    /// Whether host block `block` holds the bytes of `tag` on this rank.
    pub fn host_holds(&self, block: u32, tag: u64) -> bool {
        let expected = block_content(tag, self.rank, self.block_bytes());
        // SAFETY: in bounds; the command that wrote the block has completed.
        let actual =
            unsafe { std::slice::from_raw_parts(self.host_block_ptr(block), expected.len()) };
        actual == expected.as_slice()
    }

    /// Scribbles over host block `block` (so that a load has to bring the bytes back).
    pub fn clear_host(&self, block: u32) {
        // SAFETY: in bounds; no command touching this block is in flight.
        unsafe { std::ptr::write_bytes(self.host_block_ptr(block), 0xEE, self.block_bytes()) };
    }
}

/// SIGKILLs process `pid` after `delay`, from a thread (the caller joins it).
pub fn kill_after(pid: u32, delay: Duration) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        std::thread::sleep(delay);
        let pid = nix::unistd::Pid::from_raw(pid as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
    })
}

/// A segment configuration for the storage worker tests: 4 KiB blocks (page-aligned in the host
/// tier, so the disk tier writes them with O_DIRECT when it can), or 2 KiB with `small` (through
/// the bounce buffer).
pub fn storage_config(tp_size: u32, small: bool) -> SegmentConfig {
    SegmentConfig {
        tp_size,
        device_blocks: 16,
        host_blocks: 64,
        regions: 4,
        layers: 2,
        region_bytes: if small { 512 } else { 1024 },
        command_ring_slots: 256,
        completion_ring_slots: 64,
        ..SegmentConfig::default()
    }
}
