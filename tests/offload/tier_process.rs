//! A shared tier with real processes: `kvshm tier-owner`, and clients that are this test binary
//! run again as `client_process` (commands on stdin, one answer line each on stdout). A block
//! one client stored is a hit for another; a client SIGKILLed mid-store has its pins and pending
//! stores released while the other keeps its blocks; an owner SIGKILLed leaves its clients
//! answering misses until a new owner comes, and they attach to it.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use kvshm::offload::{
    CallAnswer, ClientOptions, OffloadKey, SharedTierError, TierCall, TierClient, TierIdentity,
};
use kvshm_ipc::name::SegmentName;

const CLIENT_ENV: &str = "KVSHM_TEST_TIER_CLIENT";

fn identity(block_bytes: u64) -> TierIdentity {
    TierIdentity {
        model: "m".into(),
        kv_dtype: "float16".into(),
        block_tokens: 16,
        block_bytes,
        blocks_per_chunk: 1,
        layout: String::new(),
    }
}

fn tier_name(test: &str) -> String {
    format!("t-tierproc-{test}-{}", std::process::id())
}

fn keys(list: &str) -> Vec<OffloadKey> {
    list.split(',').map(|n| OffloadKey::new(&[n.parse::<u8>().unwrap(); 16]).unwrap()).collect()
}

/// The owner process, once it said it serves.
struct Owner {
    child: Child,
    stdout: BufReader<ChildStdout>,
}

impl Owner {
    fn start(name: &str, chunks: u32) -> Owner {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvshm"))
            .args(["tier-owner", "--name", name, "--model", "m", "--block-bytes", "4096"])
            .args(["--chunks", &chunks.to_string(), "--clients", "4"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("kvshm runs");
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert!(line.contains(&format!("\"tier\":\"{name}\"")), "owner said {line:?}");
        Owner { child, stdout }
    }
}

impl Drop for Owner {
    /// SIGTERM: the owner removes its control object as it exits.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let _ = self.child.wait();
        }
    }
}

/// A client process, driven line by line.
struct Client {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Client {
    fn start(name: &str) -> Client {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "tier_process::client_process", "--nocapture"])
            .env(CLIENT_ENV, name)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("the test binary runs again");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Client { child, stdin, stdout }
    }

    /// Sends one command and returns its answer line.
    fn ask(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").unwrap();
        self.stdin.flush().unwrap();
        loop {
            let mut line = String::new();
            assert_ne!(self.stdout.read_line(&mut line).unwrap(), 0, "the client exited");
            if let Some(answer) = line.strip_prefix("@ ") {
                return answer.trim().to_owned();
            }
        }
    }

    fn kill(&mut self) {
        self.child.kill().unwrap(); // SIGKILL
        self.child.wait().unwrap();
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The client process: `acquire R KEYS` (hits), `prepare R KEYS` (keys to store, or
/// `refused`), `complete KEYS`, `release KEYS`, `finish R`, `connected`.
#[test]
#[ignore = "a client process that the other tests of this file start"]
fn client_process() {
    let name = std::env::var(CLIENT_ENV).expect("started by a test of this file");
    let options = ClientOptions {
        answer_deadline: Duration::from_secs(2),
        reattach_interval: Duration::from_millis(50),
    };
    let mut client =
        TierClient::new(SegmentName::new(&name).unwrap(), identity(4096), options).unwrap();
    let mut answers = Vec::new();
    for line in std::io::stdin().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        let answer = match words.as_slice() {
            ["connected"] => client.is_connected().to_string(),
            ["acquire", request, list] => {
                let keys = keys(list);
                client
                    .call(&[TierCall::AcquirePrefix { request, keys: &keys }], &mut answers)
                    .unwrap();
                match &answers[0] {
                    CallAnswer::Prefix { chunks } => chunks.len().to_string(),
                    other => panic!("{other:?}"),
                }
            }
            ["prepare", request, list] => {
                let keys = keys(list);
                client
                    .call(&[TierCall::PrepareStore { request, keys: &keys }], &mut answers)
                    .unwrap();
                match &answers[0] {
                    CallAnswer::Store { to_store, .. } => to_store.len().to_string(),
                    other => panic!("{other:?}"),
                }
            }
            ["complete", list] => {
                let keys = keys(list);
                client
                    .call(&[TierCall::CompleteStore { keys: &keys, success: true }], &mut answers)
                    .unwrap();
                "sent".to_owned()
            }
            ["release", list] => {
                let keys = keys(list);
                client.call(&[TierCall::ReleaseLoads { keys: &keys }], &mut answers).unwrap();
                "sent".to_owned()
            }
            ["finish", request] => {
                client.call(&[TierCall::FinishRequest { request }], &mut answers).unwrap();
                "sent".to_owned()
            }
            other => panic!("unknown command {other:?}"),
        };
        println!("@ {answer}");
    }
}

#[test]
fn a_block_one_client_stored_is_a_hit_for_the_other_and_a_killed_clients_pins_are_released() {
    let name = tier_name("kill-client");
    let mut owner = Owner::start(&name, 8);
    let mut doomed = Client::start(&name);
    let mut survivor = Client::start(&name);
    assert_eq!(doomed.ask("connected"), "true");
    assert_eq!(survivor.ask("connected"), "true");

    // The doomed client stores 1,2,3; they are hits for the survivor.
    assert_eq!(doomed.ask("prepare a1 1,2,3"), "3");
    doomed.ask("complete 1,2,3");
    doomed.ask("finish a1");
    assert_eq!(survivor.ask("acquire b1 1,2,3,4"), "3");
    survivor.ask("release 1,2,3");
    assert_eq!(survivor.ask("prepare b1 20,21"), "2");
    survivor.ask("complete 20,21");
    survivor.ask("finish b1");

    // The doomed client loads 1,2,3 (pinned) and is killed while storing 5,6.
    assert_eq!(doomed.ask("acquire a2 1,2,3"), "3");
    assert_eq!(doomed.ask("prepare a2 5,6"), "2");
    assert_eq!(survivor.ask("acquire b2 5"), "0", "a pending store is no hit");
    let killed = Instant::now();
    doomed.kill();
    let mut released = String::new();
    owner.stdout.read_line(&mut released).unwrap();
    eprintln!(
        "the owner released the killed client {:?} after the SIGKILL: {released}",
        killed.elapsed()
    );
    assert!(released.contains("\"pins\":3") && released.contains("\"stores\":2"), "{released}");

    // The survivor keeps serving: its blocks and the killed client's stored ones are intact,
    // the partial stores are gone, and the killed client's pins no longer hold its chunks.
    assert_eq!(survivor.ask("acquire b3 20,21"), "2");
    survivor.ask("release 20,21");
    assert_eq!(survivor.ask("acquire b3 1,2,3"), "3");
    survivor.ask("release 1,2,3");
    survivor.ask("finish b3");
    assert_eq!(survivor.ask("prepare b4 5,6"), "2", "the partial stores were dropped");
    survivor.ask("complete 5,6");
    survivor.ask("finish b4");
    assert_eq!(
        survivor.ask("prepare b5 30,31,32,33,34,35,36,37"),
        "8",
        "every chunk is evictable: the killed client's pins are gone"
    );
}

#[test]
fn clients_answer_misses_while_the_owner_is_gone_and_attach_to_the_next_one() {
    let name = tier_name("kill-owner");
    let mut owner = Owner::start(&name, 8);
    let mut first = Client::start(&name);
    let mut second = Client::start(&name);
    assert_eq!(first.ask("prepare a 1,2"), "2");
    first.ask("complete 1,2");
    assert_eq!(second.ask("acquire b 1,2"), "2");
    second.ask("release 1,2");

    owner.child.kill().unwrap(); // SIGKILL
    owner.child.wait().unwrap();
    assert_eq!(second.ask("acquire b 1,2"), "0", "a miss while the owner is gone");
    assert_eq!(second.ask("connected"), "false");
    assert_eq!(first.ask("prepare a 3"), "0", "no store while the owner is gone");

    let _next = Owner::start(&name, 8);
    let deadline = Instant::now() + Duration::from_secs(10);
    // The clients attach again at their next call after the reattach interval.
    while first.ask("prepare a 7") != "1" {
        assert!(Instant::now() < deadline, "the first client never attached to the new owner");
        std::thread::sleep(Duration::from_millis(20));
    }
    first.ask("complete 7");
    while second.ask("acquire b 7") != "1" {
        assert!(Instant::now() < deadline, "the second client never attached to the new owner");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(second.ask("connected"), "true");
}

#[test]
fn a_client_of_other_blocks_is_refused_with_the_field_that_differs() {
    let name = tier_name("mismatch");
    let _owner = Owner::start(&name, 8);
    let refused =
        TierClient::new(SegmentName::new(&name).unwrap(), identity(8192), ClientOptions::default())
            .unwrap_err();
    assert!(
        matches!(&refused, SharedTierError::Mismatch { field: "block_bytes", .. }),
        "{refused}"
    );
}
