//! A shared tier with real processes: `kvshm tier-owner`, and clients that are this test binary
//! run again as `client_process` (commands on stdin, one answer line each on stdout). A block
//! one client stored is a hit for another, its bytes read from the tier's arena as the first
//! client wrote them; a client SIGKILLed mid-store has its pins and pending stores released while
//! the other keeps its blocks; an owner SIGKILLed leaves its clients answering misses until a new
//! owner comes, which takes over the arenas, refuses stores for its grace, and serves them.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use kvshm::offload::shared::{open_rank_arena, TierArenas};

use kvshm::storage::drop::drop_namespace;
use kvshm::storage::spec::{StorageNamespace, StorageSpec};
use kvshm::storage::{disk_index, redis_listing, BlockLayout};

use crate::support::{redis_for_test, RedisServer, Scratch};
use kvshm::offload::{
    inspect_tier, CallAnswer, ClientOptions, OffloadKey, SharedTierError, StoreEnd, TierCall,
    TierClient, TierIdentity, DEAD_CLIENT_GRACE,
};
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::tier_control::{TierConfig, TierControl};

/// Bytes of one block of the tests' tiers, and chunks of each.
const BLOCK_BYTES: u64 = 4096;
const CHUNKS: u32 = 8;

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
    name: String,
    child: Child,
    stdout: BufReader<ChildStdout>,
    /// Its first line.
    ready: String,
}

impl Owner {
    fn start(name: &str, options: &[&str]) -> Owner {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvshm"))
            .args(["tier-owner", "--name", name, "--model", "m"])
            .args(["--block-bytes", &BLOCK_BYTES.to_string()])
            .args(["--chunks", &CHUNKS.to_string(), "--clients", "4"])
            .args(options)
            .stdout(Stdio::piped())
            .spawn()
            .expect("kvshm runs");
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut ready = String::new();
        stdout.read_line(&mut ready).unwrap();
        assert!(ready.contains(&format!("\"tier\":\"{name}\"")), "owner said {ready:?}");
        Owner { name: name.to_owned(), child, stdout, ready }
    }
}

impl Owner {
    /// SIGTERM, and the owner's last line (its counters).
    fn stop(&mut self) -> String {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        let mut last = String::new();
        for line in (&mut self.stdout).lines() {
            last = line.unwrap();
        }
        self.child.wait().unwrap();
        last
    }
}

impl Drop for Owner {
    /// SIGTERM: the owner removes its control object as it exits; the test removes the arena
    /// and key table the owner leaves for the next one.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let _ = self.child.wait();
        }
        TierArenas::unlink(&SegmentName::new(&self.name).unwrap(), 1);
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

/// The client process: `acquire R KEYS` (hits, then `+N` when N more are coming from the
/// tier's storage), `prepare R KEYS` (keys to store, or `refused`),
/// `complete KEYS`, `release KEYS`, `finish R`, `connected`; and with the bytes, as an engine
/// copies them: `store R KEYS BYTE` (prepare, fill each chunk given with BYTE in the tier's
/// arena, complete; how many were stored), `load R KEYS` (acquire, read each chunk found,
/// release; the byte each chunk holds, or `torn` for one that is not all one byte).
#[test]
#[ignore = "a client process that the other tests of this file start"]
fn client_process() {
    let name = std::env::var(CLIENT_ENV).expect("started by a test of this file");
    let options = ClientOptions {
        answer_deadline: Duration::from_secs(2),
        reattach_interval: Duration::from_millis(50),
        ..ClientOptions::default()
    };
    let name = SegmentName::new(&name).unwrap();
    let mut client = TierClient::new(name.clone(), identity(BLOCK_BYTES), options).unwrap();
    let arena = open_rank_arena(&name, 0, u64::from(CHUNKS), BLOCK_BYTES).unwrap();
    let block = BLOCK_BYTES as usize;
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
                    CallAnswer::Prefix { chunks, promoting: 0 } => chunks.len().to_string(),
                    CallAnswer::Prefix { chunks, promoting } => {
                        format!("{}+{promoting}", chunks.len())
                    }
                    other => panic!("{other:?}"),
                }
            }
            ["prepare", request, list] => {
                let keys = keys(list);
                client
                    .call(&[TierCall::PrepareStore { request, keys: &keys }], &mut answers)
                    .unwrap();
                match &answers[0] {
                    CallAnswer::Store { refused: true, .. } => "refused".to_owned(),
                    CallAnswer::Store { to_store, .. } => to_store.len().to_string(),
                    other => panic!("{other:?}"),
                }
            }
            ["store", request, list, byte] => {
                let (keys, byte) = (keys(list), byte.parse::<u8>().unwrap());
                client
                    .call(&[TierCall::PrepareStore { request, keys: &keys }], &mut answers)
                    .unwrap();
                let CallAnswer::Store { to_store, chunks, .. } = answers[0].clone() else {
                    panic!("{:?}", answers[0])
                };
                for &chunk in &chunks {
                    arena.write_data(chunk as usize * block, &vec![byte; block]).unwrap();
                }
                let stored: Vec<OffloadKey> =
                    to_store.iter().map(|&index| keys[index as usize]).collect();
                let complete = TierCall::CompleteStore { keys: &stored, end: StoreEnd::Stored };
                client.call(&[complete], &mut answers).unwrap();
                stored.len().to_string()
            }
            ["load", request, list] => {
                let keys = keys(list);
                client
                    .call(&[TierCall::AcquirePrefix { request, keys: &keys }], &mut answers)
                    .unwrap();
                let CallAnswer::Prefix { chunks, .. } = answers[0].clone() else {
                    panic!("{:?}", answers[0])
                };
                let mut bytes = vec![0; block];
                let read: Vec<String> = chunks
                    .iter()
                    .map(|&chunk| {
                        arena.read_data(chunk as usize * block, &mut bytes).unwrap();
                        let first = bytes[0];
                        if bytes.iter().all(|&b| b == first) {
                            first.to_string()
                        } else {
                            "torn".to_owned()
                        }
                    })
                    .collect();
                let loaded = &keys[..chunks.len()];
                client.call(&[TierCall::ReleaseLoads { keys: loaded }], &mut answers).unwrap();
                read.join(",")
            }
            ["complete", list] => {
                let keys = keys(list);
                client
                    .call(
                        &[TierCall::CompleteStore { keys: &keys, end: StoreEnd::Stored }],
                        &mut answers,
                    )
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
    let mut owner = Owner::start(&name, &[]);
    let mut doomed = Client::start(&name);
    let mut survivor = Client::start(&name);
    assert_eq!(doomed.ask("connected"), "true");
    assert_eq!(survivor.ask("connected"), "true");

    // The doomed client stores 1,2,3; they are hits for the survivor, which reads the bytes
    // the doomed client wrote into the tier's arena.
    assert_eq!(doomed.ask("store a1 1,2,3 11"), "3");
    doomed.ask("finish a1");
    assert_eq!(survivor.ask("load b1 1,2,3,4"), "11,11,11");
    assert_eq!(survivor.ask("prepare b1 1,2,3"), "0", "in the tier already: not refused");
    assert_eq!(survivor.ask("store b1 20,21 22"), "2");
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
    assert!(released.contains("\"held_back\":2"), "its partial stores' chunks: {released}");

    // The survivor keeps serving: its blocks and the killed client's stored ones are intact,
    // the partial stores are gone, and the killed client's pins no longer hold its chunks.
    assert_eq!(survivor.ask("load b3 20,21"), "22,22");
    assert_eq!(survivor.ask("load b3 1,2,3"), "11,11,11");
    survivor.ask("finish b3");
    assert_eq!(survivor.ask("prepare b4 5,6"), "2", "the partial stores were dropped");
    survivor.ask("complete 5,6");
    survivor.ask("finish b4");
    // Once the killed client's copy side can no longer be writing the chunks of its partial
    // stores, they are free again.
    std::thread::sleep(DEAD_CLIENT_GRACE + Duration::from_millis(100));
    assert_eq!(
        survivor.ask("prepare b5 30,31,32,33,34,35,36,37"),
        "8",
        "every chunk is evictable: the killed client's pins are gone"
    );
}

#[test]
fn clients_answer_misses_while_the_owner_is_gone_and_attach_to_the_next_one() {
    let name = tier_name("kill-owner");
    let mut owner = Owner::start(&name, &[]);
    assert!(owner.ready.contains("\"arenas_taken_over\":false"), "{}", owner.ready);
    let mut first = Client::start(&name);
    let mut second = Client::start(&name);
    assert_eq!(first.ask("store a 1,2 5"), "2");
    assert_eq!(second.ask("load b 1,2"), "5,5");
    // A store prepared and never completed: its chunk may be half written when the owner dies.
    assert_eq!(first.ask("prepare a 4"), "1");

    owner.child.kill().unwrap(); // SIGKILL
    owner.child.wait().unwrap();
    assert_eq!(second.ask("acquire b 1,2"), "0", "a miss while the owner is gone");
    assert_eq!(second.ask("connected"), "false");
    assert_eq!(first.ask("prepare a 3"), "refused", "no store while the owner is gone");

    // The next owner takes over the arena the clients map (its bytes kept) and the keys its key
    // table names (the completed stores, not the pending one), and hands out no chunk for a
    // store during its grace: the dead owner's clients may still be writing the chunks it gave
    // them.
    let grace = Duration::from_millis(1500);
    let next = Owner::start(&name, &["--takeover-grace-ms", &grace.as_millis().to_string()]);
    let served_at = Instant::now();
    assert!(next.ready.contains("\"arenas_taken_over\":true"), "{}", next.ready);
    assert!(next.ready.contains("\"keys_restored\":2"), "{}", next.ready);
    let deadline = Instant::now() + Duration::from_secs(15);
    // The clients attach again at their next call after the reattach interval.
    while second.ask("load b 1,2") != "5,5" {
        assert!(Instant::now() < deadline, "the second client never loaded the old keys");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(second.ask("load b 4"), "", "a store left pending is not restored");
    while first.ask("store a 7 9") != "1" {
        assert!(Instant::now() < deadline, "the first client never stored through the new owner");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        served_at.elapsed() >= grace - Duration::from_millis(100),
        "a store was served {:?} after the takeover, inside the grace of {grace:?}",
        served_at.elapsed()
    );
    assert_eq!(first.ask("connected"), "true");
    assert_eq!(second.ask("load b 7"), "9");
}

/// An owner started while another sets the tier up (its control object made, closed to
/// clients) stops before touching the arenas, saying another owner may serve; one that fails
/// on its own once it holds the name says that instead, and removes its control object first.
#[test]
fn an_owner_that_fails_says_whether_another_may_serve_and_whether_it_held_the_name() {
    let name = tier_name("fails");
    let segment = SegmentName::new(&name).unwrap();
    let failure_of = |options: &[&str]| {
        let owner = Command::new(env!("CARGO_BIN_EXE_kvshm"))
            .args(["tier-owner", "--name", &name, "--model", "m"])
            .args(["--block-bytes", &BLOCK_BYTES.to_string()])
            .args(["--chunks", &CHUNKS.to_string()])
            .args(options)
            .output()
            .expect("kvshm runs");
        assert!(!owner.status.success());
        let out = String::from_utf8(owner.stdout).unwrap();
        let line: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        (line["another_owner_may_serve"].clone(), line["held_the_name"].clone(), line)
    };
    let identity = identity(BLOCK_BYTES).encode();
    let setting_up =
        TierControl::create_closed(&segment, &TierConfig::with_clients(4), &identity).unwrap();
    let (may_serve, held, line) = failure_of(&[]);
    assert_eq!((may_serve, held), (true.into(), false.into()), "{line}");
    assert!(line["failed"].as_str().unwrap().contains("being set up"), "{line}");
    let arena = kvshm_ipc::arena::Arena::open(&segment, kvshm_ipc::arena::ArenaKind::Host, 0);
    assert!(arena.is_err(), "the arenas were left alone");
    drop(setting_up);

    let scratch = Scratch::new("owner-fails");
    let not_a_directory = scratch.0.join("file");
    std::fs::write(&not_a_directory, b"").unwrap();
    let storage = format!("disk:{}", not_a_directory.display());
    let (may_serve, held, line) = failure_of(&["--storage", &storage]);
    assert_eq!((may_serve, held), (false.into(), true.into()), "{line}");
    assert!(TierControl::attach(&segment).is_err() && TierControl::setting_up(&segment).is_none());
    TierArenas::unlink(&segment, 1);
}

#[test]
fn a_client_of_other_blocks_is_refused_with_the_field_that_differs() {
    let name = tier_name("mismatch");
    let _owner = Owner::start(&name, &[]);
    let refused =
        TierClient::new(SegmentName::new(&name).unwrap(), identity(8192), ClientOptions::default())
            .unwrap_err();
    assert!(
        matches!(&refused, SharedTierError::Mismatch { field: "block_bytes", .. }),
        "{refused}"
    );
}

/// A client that gives up on an owner stalled past its answer deadline (here SIGSTOPped) leaves
/// its slot and pins there while its process lives (its engine's copies may still be running:
/// no chunk of it may go to another store), and the owner releases them once the process exits.
#[test]
fn a_client_that_gives_up_on_a_stalled_owner_keeps_its_pins_until_it_exits() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;

    let name = tier_name("stalled");
    let mut owner = Owner::start(&name, &[]);
    let tier = SegmentName::new(&name).unwrap();
    let mut client = Client::start(&name);
    assert_eq!(client.ask("store a 1,2 3"), "2");
    assert_eq!(client.ask("acquire a 1,2"), "2", "two pins held");

    let pid = Pid::from_raw(owner.child.id() as i32);
    kill(pid, Signal::SIGSTOP).unwrap();
    assert_eq!(client.ask("acquire b 1"), "0", "a miss once the answer deadline passed");
    assert_eq!(client.ask("connected"), "false");
    kill(pid, Signal::SIGCONT).unwrap();

    // The client attaches again (a new slot) and finds its blocks; the old slot keeps its pins.
    let deadline = Instant::now() + Duration::from_secs(10);
    while client.ask("load c 1,2") != "3,3" {
        assert!(Instant::now() < deadline, "the client never attached again");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pins = |report: &kvshm::offload::TierReport| report.clients.iter().map(|r| r.pins).sum();
    let held: u32 = pins(&inspect_tier(&tier).unwrap());
    assert!(held >= 2, "the abandoned slot's pins stay while the process lives: {held}");

    client.kill();
    let mut released = String::new();
    owner.stdout.read_line(&mut released).unwrap();
    assert!(released.contains("\"died\":true"), "{released}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !inspect_tier(&tier).unwrap().clients.is_empty() {
        assert!(Instant::now() < deadline, "both slots are released once the process exited");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `--client-quota`: a client at its quota evicts its own least recently used leaf to store
/// another, never a block of the other client, even with chunks free.
#[test]
fn a_client_at_its_quota_evicts_its_own_blocks_not_another_clients() {
    let name = tier_name("quota");
    let _owner = Owner::start(&name, &["--client-quota", "2"]);
    let mut first = Client::start(&name);
    let mut second = Client::start(&name);
    assert_eq!(second.ask("store b 10,11 4"), "2");
    second.ask("finish b");
    assert_eq!(first.ask("store a 1,2 5"), "2");
    first.ask("finish a");
    assert_eq!(first.ask("store a2 3 6"), "1", "at its quota: one of its own makes room");
    first.ask("finish a2");
    assert_eq!(second.ask("load c 10,11"), "4,4", "the other client's blocks stay");
    assert_eq!(first.ask("load d 3"), "6");
    // Its chain 1 -> 2 lost its leaf (leaf-first LRU), with 4 of the 8 chunks free.
    assert_eq!(first.ask("load d 2"), "", "its least recently used leaf went");
    assert_eq!(first.ask("load d 1"), "5");
}

/// `--idle-exit-s`: an owner with no client attached exits and removes the tier, but not while
/// another process maps an arena (an engine's copy side starts before its scheduler attaches:
/// a new owner's arenas would not be the ones it copies into).
#[test]
fn an_idle_owner_keeps_the_tier_while_a_process_maps_its_arena() {
    let name = tier_name("idle");
    let mut owner = Owner::start(&name, &["--idle-exit-s", "1"]);
    let tier = SegmentName::new(&name).unwrap();
    let mapped = open_rank_arena(&tier, 0, u64::from(CHUNKS), BLOCK_BYTES).unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    assert!(owner.child.try_wait().unwrap().is_none(), "it exited with its arena mapped");

    drop(mapped);
    let deadline = Instant::now() + Duration::from_secs(10);
    while owner.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the idle owner never exited");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(open_rank_arena(&tier, 0, u64::from(CHUNKS), BLOCK_BYTES).is_err(), "removed");
}

/// `--storage disk:DIR`: every block a client stores is written through to disk; one the arena
/// evicted is brought back when a client asks for it (the client is told it is coming, then
/// loads the bytes first stored); a new owner of an empty arena finds on disk what the last one
/// wrote; and a block whose bytes on disk were damaged is a miss, never loaded.
#[test]
fn blocks_evicted_from_the_arena_come_back_from_the_storage_tier() {
    let scratch = Scratch::new("tier-storage");
    let storage = format!("disk:{}", scratch.0.display());
    let name = tier_name("storage");
    evicted_blocks_come_back(&name, &storage, || blocks_on_disk(&scratch));

    // Every byte of the slab damaged: the blocks are listed (the index is intact) but each read
    // fails its checksum, a miss; no client ever loads them.
    let slab = namespace_dir(&scratch).join("rank-0.slab");
    let len = std::fs::metadata(&slab).unwrap().len();
    std::fs::write(&slab, vec![0xee; len as usize]).unwrap();
    let mut owner = Owner::start(&name, &["--storage", &storage]);
    let mut reader = Client::start(&name);
    assert_eq!(reader.ask("acquire f 11,12"), "0+2");
    let deadline = Instant::now() + Duration::from_secs(10);
    while reader.ask("acquire f 11,12") != "0" {
        assert!(Instant::now() < deadline, "the damaged reads never finished");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(reader.ask("load f 11,12"), "", "a damaged block is a miss");
    let storage = storage_figures(&owner.stop());
    assert_eq!(
        (storage["promoted"].as_u64(), storage["promotions_missed"].as_u64()),
        (Some(0), Some(2))
    );
}

/// The same with Redis below the tier.
#[test]
fn blocks_evicted_from_the_arena_come_back_from_a_redis_storage_tier() {
    let redis = redis_for_test();
    let url = redis.url();
    let namespace = identity(BLOCK_BYTES).storage_namespace();
    let layout = BlockLayout::new(BLOCK_BYTES, 1, 1).unwrap();
    let drop = || {
        let spec: StorageSpec = url.parse().unwrap();
        let namespace = StorageNamespace::new(&namespace).unwrap();
        drop_namespace(&spec, &namespace, Duration::from_secs(2)).unwrap();
    };
    drop();
    let stored = || {
        redis_listing::blocks_on_every_rank(&url, &namespace, &layout, Duration::from_secs(2))
            .unwrap()
            .len()
    };
    evicted_blocks_come_back(&tier_name("redis-storage"), &url, stored);
    drop();
}

/// A writer of tier `name` stores 1..8 (byte 11) in its 8-chunk arena, then 9..16 (byte 22)
/// once 1..8 are on storage, evicting them all, and waits until 9..16 are on storage too (then
/// none is pinned: any can go to bring others back). `stored` counts what the storage holds.
fn fill_then_evict(name: &str, stored: &impl Fn() -> usize) -> Client {
    let mut writer = Client::start(name);
    assert_eq!(writer.ask("store a 1,2,3,4,5,6,7,8 11"), "8");
    writer.ask("finish a");
    // A block being written is pinned: until 1..8 are written, the store is refused.
    let deadline = Instant::now() + Duration::from_secs(10);
    while writer.ask("store b 9,10,11,12,13,14,15,16 22") != "8" {
        assert!(Instant::now() < deadline, "the writes to storage never finished");
        std::thread::sleep(Duration::from_millis(10));
    }
    writer.ask("finish b");
    while stored() < 16 {
        assert!(Instant::now() < deadline, "the writes of 9..16 never finished");
        std::thread::sleep(Duration::from_millis(5));
    }
    writer
}

/// A storage that hangs (a Redis stopped with SIGSTOP) stalls no engine for long: a key being
/// brought back counts as coming for a second at most (the engine looks it up again meanwhile),
/// then it is a miss (the engine computes the block) while the read waits for the storage's
/// timeout; the owner serves on throughout, and brings the block back once the storage is.
#[test]
fn a_hung_storage_delays_a_lookup_by_a_second_at_most() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    let namespace = identity(BLOCK_BYTES).storage_namespace();
    let layout = BlockLayout::new(BLOCK_BYTES, 1, 1).unwrap();
    let stored = || {
        redis_listing::blocks_on_every_rank(&url, &namespace, &layout, Duration::from_secs(2))
            .unwrap()
            .len()
    };
    let name = tier_name("hung-storage");
    let _owner = Owner::start(&name, &["--storage", &url]);
    let mut writer = fill_then_evict(&name, &stored);

    redis.pause();
    let mut reader = Client::start(&name);
    assert_eq!(reader.ask("acquire c 1,2"), "0+2");
    let asked = Instant::now();
    while reader.ask("acquire c 1,2") == "0+2" {
        assert!(asked.elapsed() < Duration::from_millis(1500), "still coming after 1.5 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        asked.elapsed() >= Duration::from_millis(900),
        "no longer coming after {:?}",
        asked.elapsed()
    );
    assert_eq!(reader.ask("acquire c 1,2"), "0", "a miss while the storage hangs");
    assert_eq!(writer.ask("load w 9,10"), "22,22", "the owner serves on");
    // Stopped past the back-end's timeout (2 s): the reads fail, and the owner keeps believing
    // the storage holds 1,2 (a failure is no absence); with Redis back they come back.
    std::thread::sleep(Duration::from_millis(2500).saturating_sub(asked.elapsed()));
    redis.resume();
    assert_eq!(wait_for_load(&mut reader, "d 1,2"), "11,11", "brought back once Redis is back");
}

/// Module scenario of the storage tests: a writer fills the 8-chunk arena with 1..8, then with
/// 9..16 once 1..8 are on storage (`stored` counts what the storage holds); a reader is told
/// 1..3 are coming and loads their bytes; a new owner with new arenas lists all 16 on storage
/// and brings 9,10 back.
fn evicted_blocks_come_back(name: &str, storage: &str, stored: impl Fn() -> usize) {
    let with_storage = ["--storage", storage, "--storage-chunks", "64"];
    let mut owner = Owner::start(name, &with_storage);
    assert!(owner.ready.contains("\"storage_held\":0"), "{}", owner.ready);
    let writer = fill_then_evict(name, &stored);
    let mut reader = Client::start(name);
    assert_eq!(reader.ask("acquire c 1,2,3,40"), "0+3", "evicted, and coming back");
    assert_eq!(wait_for_load(&mut reader, "c 1,2,3"), "11,11,11", "the bytes first stored");
    assert_eq!(reader.ask("acquire d 1,2,3,40"), "3", "40 was never stored");
    reader.ask("release 1,2,3");
    // What `kvctl tier` shows: the owner's figures of the storage below, published each turn.
    let storage = inspect_tier(&SegmentName::new(name).unwrap()).unwrap().storage.unwrap();
    assert_eq!((storage.held, storage.promoted, storage.promoting), (16, 3, 0), "{storage:?}");
    let storage = storage_figures(&owner.stop());
    assert_eq!(
        (storage["promoted"].as_u64(), storage["promotions_missed"].as_u64()),
        (Some(3), Some(0))
    );
    drop((reader, writer, owner));

    // A new owner with new, empty arenas (the old ones were removed): what the last one wrote
    // is listed from storage, and comes back as it was stored.
    let mut owner = Owner::start(name, &with_storage);
    assert!(owner.ready.contains("\"storage_held\":16"), "{}", owner.ready);
    let mut reader = Client::start(name);
    assert_eq!(reader.ask("acquire e 9,10"), "0+2");
    assert_eq!(wait_for_load(&mut reader, "e 9,10"), "22,22");
    owner.stop();
}

/// The storage tier's figures in an owner's last line.
fn storage_figures(last: &str) -> serde_json::Value {
    let line: serde_json::Value = serde_json::from_str(last).unwrap();
    line["storage"].clone()
}

/// The one namespace directory a tier's storage made under `scratch`.
fn namespace_dir(scratch: &Scratch) -> std::path::PathBuf {
    std::fs::read_dir(&scratch.0).unwrap().next().unwrap().unwrap().path()
}

/// The blocks the tier's disk storage under `scratch` holds (its index read as written).
fn blocks_on_disk(scratch: &Scratch) -> usize {
    let layout = BlockLayout::new(BLOCK_BYTES, 1, 1).unwrap();
    disk_index::read_index(&namespace_dir(scratch), 0, &layout).map_or(0, |blocks| blocks.len())
}

/// Loads `request keys` until the tier has them (the answer is not empty) or 10 s have passed.
fn wait_for_load(client: &mut Client, request_and_keys: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let loaded = client.ask(&format!("load {request_and_keys}"));
        if !loaded.is_empty() || Instant::now() > deadline {
            return loaded;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
