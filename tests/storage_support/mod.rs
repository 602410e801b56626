//! Support for the storage tests: private Redis servers and scratch directories.
//!
//! `scripts/test` starts one private `redis-server` for the whole run and exports its URL in
//! [`REDIS_URL_ENV`]; tests that only need a server use it ([`redis_for_test`]). Tests that stop
//! and restart their server, and runs without that variable (a plain `cargo test`), start their
//! own with [`RedisServer::start`] on a free loopback port; it is killed when dropped, also when
//! the test fails. Without `redis-server` installed the tests fail loudly: they never skip.
#![allow(dead_code)]

#[path = "../ring_driver/mod.rs"]
mod ring_driver;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The URL of the Redis server `scripts/test` started for this run.
pub const REDIS_URL_ENV: &str = "KVSHM_TEST_REDIS_URL";
/// The `redis-server` binary to start (default: `redis-server` from PATH).
pub const REDIS_SERVER_ENV: &str = "KVSHM_TEST_REDIS_SERVER";

/// A scratch directory removed when dropped.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        use kvshm_ipc::sync::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let serial = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kvshm-{tag}-{}-{serial}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A `redis-server` this test started; killed when dropped.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: Scratch,
}

fn server_binary() -> String {
    let binary = std::env::var(REDIS_SERVER_ENV).unwrap_or_else(|_| "redis-server".to_owned());
    let found = Command::new(&binary)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    assert!(
        found,
        "{binary} is not installed: the Redis storage tests need it (they never skip). Run \
         `bash scripts/test`, which installs it, or `apt-get install redis-server`."
    );
    binary
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl RedisServer {
    /// Starts a private server on a free loopback port (retrying if another process takes the
    /// port first), waiting until it answers PING.
    pub fn start() -> RedisServer {
        for _ in 0..5 {
            if let Some(server) = RedisServer::try_start(free_port(), Scratch::new("redis")) {
                return server;
            }
        }
        panic!("could not start a private redis-server after 5 attempts");
    }

    fn try_start(port: u16, dir: Scratch) -> Option<RedisServer> {
        let mut server = RedisServer { child: None, port, dir };
        server.spawn();
        server.wait_ready().then_some(server)
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(self.dir.0.join("redis.log")).unwrap();
        let child = Command::new(server_binary())
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .args(["--daemonize", "no", "--loglevel", "warning"])
            .arg("--dir")
            .arg(&self.dir.0)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawning redis-server");
        self.child = Some(child);
    }

    /// Whether the server answers PING within 10 s (false if it exited: its port was taken).
    fn wait_ready(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(child) = &mut self.child {
                if child.try_wait().unwrap().is_some() {
                    self.child = None;
                    return false;
                }
            }
            if ping(&self.url()) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Kills the server at once (SIGKILL): Redis "goes away".
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port (empty: it keeps nothing on disk).
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            self.spawn();
            if self.wait_ready() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not come back on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether a server at `url` answers PING.
pub fn ping(url: &str) -> bool {
    let Ok(client) = redis::Client::open(url) else { return false };
    let Ok(mut connection) = client.get_connection_with_timeout(Duration::from_millis(200)) else {
        return false;
    };
    redis::cmd("PING").query::<String>(&mut connection).is_ok()
}

/// A Redis server for a test: the run's shared one, or a private one.
pub enum TestRedis {
    Shared(String),
    Own(RedisServer),
}

impl TestRedis {
    pub fn url(&self) -> String {
        match self {
            TestRedis::Shared(url) => url.clone(),
            TestRedis::Own(server) => server.url(),
        }
    }
}

/// The run's shared server if `scripts/test` started one (it must answer), else a private one.
pub fn redis_for_test() -> TestRedis {
    match std::env::var(REDIS_URL_ENV) {
        Ok(url) => {
            assert!(ping(&url), "{REDIS_URL_ENV}={url} does not answer PING");
            TestRedis::Shared(url)
        }
        Err(_) => TestRedis::Own(RedisServer::start()),
    }
}

/// The URL of a "Redis" that accepts connections and never answers (every request waits for the
/// client's timeout). It lives until the test process exits.
pub fn silent_redis() -> String {
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}", silent.local_addr().unwrap());
    std::thread::spawn(move || {
        // Hold every connection open, unanswered.
        let _held: Vec<_> = silent.incoming().collect();
    });
    url
}

/// A blocking connection to `url` for a test's own reads and writes.
pub fn connect(url: &str) -> redis::Connection {
    redis::Client::open(url).unwrap().get_connection_with_timeout(Duration::from_secs(5)).unwrap()
}

/// A namespace no other test (or test run) uses.
pub fn unique_namespace(tag: &str) -> String {
    use kvshm_ipc::sync::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!("t{}-{}-{tag}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

// ---- Driving a real `kvshm worker` with a storage tier, the way the scheduler will. ----

use kvshm_ipc::arena::{Arena, ArenaKind};
use kvshm_ipc::config::SegmentConfig;
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::record::{CommandHeader, Op};
use kvshm_ipc::segment::Segment;
use kvshm_ipc::storage_record::{
    encode_storage_command, storage_pair_count, StorageEntry, StorageResults,
};
use kvshm_ipc::worker_slot::RankStatus;
pub use ring_driver::RingDriver;

/// Generous bound for anything the worker tests wait for; reaching it is a failure.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// A segment name no other test (or test run) uses.
pub fn unique_segment(tag: &str) -> SegmentName {
    use kvshm_ipc::sync::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let serial = NEXT.fetch_add(1, Ordering::Relaxed);
    SegmentName::new(&format!("st{}-{serial}-{tag}", std::process::id())).unwrap()
}

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
        use std::io::Read;
        let deadline = Instant::now() + PATIENCE;
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

    /// SIGKILL and reap.
    pub fn kill_hard(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for a clean exit.
    pub fn stop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.pid() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
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
        let header = self.send_storage(op, entries);
        let completion = self.completions(1)[0];
        assert_eq!(completion.command_id, header.command_id);
        assert!(completion.is_ok(), "{op:?} failed: {completion:?}");
        StorageResults::from_detail(completion.detail)
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

/// `len` pseudo-random bytes from `seed` (xorshift): blocks of different seeds differ everywhere.
pub fn pattern_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// The bytes of block `tag` on `rank` (every rank's part differs, as on a real TP engine).
pub fn block_content(tag: u64, rank: u32, len: usize) -> Vec<u8> {
    pattern_bytes(tag ^ (u64::from(rank) << 40), len)
}

/// SIGKILLs process `pid` after `delay`, from a thread (the caller joins it).
pub fn kill_after(pid: u32, delay: Duration) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        std::thread::sleep(delay);
        let pid = nix::unistd::Pid::from_raw(pid as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
    })
}

/// The storage entry of block `tag` (hash derived from the tag, parent the previous tag, depth
/// the tag) read from or written to `host_block`.
pub fn entry(tag: u64, host_block: u32) -> StorageEntry {
    StorageEntry::new(block_hash(tag), block_hash(tag.wrapping_sub(1)), tag as u32, host_block)
}

pub fn block_hash(tag: u64) -> u128 {
    (u128::from(tag) << 64) | 0x0570_7a6e
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
