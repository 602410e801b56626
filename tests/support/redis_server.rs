//! Redis servers for the storage tests: the run's shared one, private ones, and a silent one.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::scratch::Scratch;

/// The URL of the Redis server `scripts/test` started for this run.
pub const REDIS_URL_ENV: &str = "KVSHM_TEST_REDIS_URL";
/// The `redis-server` binary to start (default: `redis-server` from PATH).
pub const REDIS_SERVER_ENV: &str = "KVSHM_TEST_REDIS_SERVER";

/// A `redis-server` this test started; killed when dropped.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: Scratch,
    /// Configuration given on the command line besides the defaults.
    config: Vec<String>,
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
        RedisServer::start_with(&[])
    }

    /// [`RedisServer::start`] with `config` on the command line besides the defaults (for
    /// example `--rename-command GETEX ""`: a server without that command, as older ones are).
    pub fn start_with(config: &[&str]) -> RedisServer {
        let config: Vec<String> = config.iter().map(|&word| word.to_owned()).collect();
        for _ in 0..5 {
            let dir = Scratch::new("redis");
            if let Some(server) = RedisServer::try_start(free_port(), dir, config.clone()) {
                return server;
            }
        }
        panic!("could not start a private redis-server after 5 attempts");
    }

    fn try_start(port: u16, dir: Scratch, config: Vec<String>) -> Option<RedisServer> {
        let mut server = RedisServer { child: None, port, dir, config };
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
            .args(&self.config)
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
            // A paused server dies of SIGKILL all the same; SIGCONT is harmless otherwise.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGCONT,
            );
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the server (SIGSTOP): it keeps its connections and accepts new ones (the kernel
    /// does), but answers nothing: a hung Redis.
    pub fn pause(&mut self) {
        self.signal(nix::sys::signal::Signal::SIGSTOP);
    }

    /// Lets a paused server go on (SIGCONT): it answers what waited, with its data intact.
    pub fn resume(&mut self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
    }

    fn signal(&mut self, signal: nix::sys::signal::Signal) {
        let child = self.child.as_ref().expect("the server is running");
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        nix::sys::signal::kill(pid, signal).expect("signalling our own redis-server");
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
    format!("t{}-{}-{tag}", std::process::id(), super::serial())
}
