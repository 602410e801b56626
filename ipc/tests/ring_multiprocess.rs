//! Rings and doorbells between two real processes.
//!
//! The test binary re-executes itself as the child (selected by [`CHILD_ENV`], which carries the
//! shared-memory object name). The parent creates one object holding two doorbells, a command
//! ring (parent -> child) and a completion ring (child -> parent):
//!
//! 1. the parent sends one million 64-byte command slots in batches of mixed sizes, each carrying
//!    its sequence number, payload words derived from it and a checksum;
//! 2. the child checks every slot (sequence, payload, checksum) and answers each with a
//!    completion that echoes the sequence number and the checksum;
//! 3. the parent checks every completion in order.
//!
//! Both sides wait on the doorbells (spin briefly, then sleep on the shared futex). Like the
//! scheduler, the parent never has more commands in flight than the completion ring holds, so the
//! child never finds the completion ring full.
#![cfg(not(loom))]

use std::process::{Command, Stdio};
use std::time::Duration;

use kvshm_ipc::doorbell::{Doorbell, WaitOutcome, WaitPolicy};
use kvshm_ipc::record::{CommandSlot, Completion};
use kvshm_ipc::ring::{self, Consumer, Producer};
use kvshm_ipc::shm::{self, SharedMemory};

const CHILD_ENV: &str = "KVSHM_RING_TEST_CHILD";
const RECORDS: u64 = 1_000_000;
const COMMAND_CAPACITY: usize = 64;
const COMPLETION_CAPACITY: usize = 128;
const LARGEST_BATCH: u64 = 48;

/// Offsets of the parts inside the shared object.
struct Layout {
    commands_bell: usize,
    completions_bell: usize,
    commands: usize,
    completions: usize,
    len: usize,
}

impl Layout {
    fn new() -> Self {
        let commands = 2 * size_of::<Doorbell>();
        let completions = commands + ring::memory_size::<CommandSlot>(COMMAND_CAPACITY);
        let len = completions + ring::memory_size::<Completion>(COMPLETION_CAPACITY);
        Layout {
            commands_bell: 0,
            completions_bell: size_of::<Doorbell>(),
            commands,
            completions,
            len,
        }
    }
}

/// Both sides' view of the shared object.
struct Channel {
    memory: SharedMemory,
    layout: Layout,
}

impl Channel {
    fn doorbell(&self, offset: usize) -> &Doorbell {
        assert!(offset + size_of::<Doorbell>() <= self.memory.len());
        // SAFETY: 1. the offset is inside the mapping (checked) and a multiple of 64 from a
        // page-aligned base; 2. a Doorbell is atomics only, byte for byte, and any bits are a
        // valid doorbell, so the reference stays sound while the other process writes it;
        // 3. the reference lives no longer than `self`, which keeps the map.
        unsafe { &*self.memory.as_ptr().add(offset).cast::<Doorbell>() }
    }

    fn commands_bell(&self) -> &Doorbell {
        self.doorbell(self.layout.commands_bell)
    }

    fn completions_bell(&self) -> &Doorbell {
        self.doorbell(self.layout.completions_bell)
    }

    /// (base, len) of the ring at `offset`, which ends where `end` starts.
    fn ring_memory(&self, offset: usize, end: usize) -> (*mut u8, usize) {
        assert!(end <= self.memory.len());
        // SAFETY: offset < end <= the mapping's length.
        (unsafe { self.memory.as_ptr().add(offset) }, end - offset)
    }
}

fn splitmix(mut state: u64) -> u64 {
    state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn checksum(words: &[u64]) -> u64 {
    words
        .iter()
        .fold(0xCBF2_9CE4_8422_2325, |sum, word| (sum ^ word).wrapping_mul(0x1000_0000_01B3))
}

/// Command slot `sequence`: the sequence number, six payload words, the checksum of the seven.
fn command(sequence: u64) -> CommandSlot {
    let mut words = [0u64; 8];
    words[0] = sequence;
    for (index, word) in words[1..7].iter_mut().enumerate() {
        *word = splitmix(sequence * 8 + index as u64);
    }
    words[7] = checksum(&words[..7]);
    CommandSlot { words }
}

/// Waits on `bell` until `ready`, failing the test if the peer stays silent for `patience`.
fn wait_or_fail(bell: &Doorbell, ready: impl FnMut() -> bool, patience: Duration, what: &str) {
    let policy =
        WaitPolicy::new(Duration::from_micros(5), Duration::from_millis(20)).within(patience);
    assert_eq!(bell.wait_until(ready, policy), WaitOutcome::Ready, "{what}");
}

#[test]
fn a_million_records_cross_to_a_child_process_and_back_intact() {
    if let Ok(object) = std::env::var(CHILD_ENV) {
        run_child(&object);
        return;
    }
    let object = format!("/kvshm-test-ring-{}", std::process::id());
    let _ = shm::unlink(&object);
    let layout = Layout::new();
    let memory = SharedMemory::create(&object, layout.len).expect("create the test object");
    let _unlink = UnlinkOnDrop(object.clone());
    let channel = Channel { memory, layout };
    let layout = &channel.layout;
    let (base, len) = channel.ring_memory(layout.commands, layout.completions);
    // SAFETY: fresh memory, 64-byte aligned (page-aligned base plus 128), of memory_size bytes,
    // that nobody attached yet.
    unsafe { ring::init::<CommandSlot>(base, COMMAND_CAPACITY) };
    // SAFETY: the mapping outlives the producer; the child attaches the only consumer.
    let mut commands = unsafe { Producer::<CommandSlot>::attach(base, len) }.unwrap();
    let (base, len) = channel.ring_memory(layout.completions, layout.len);
    // SAFETY: as above, for the completion ring.
    unsafe { ring::init::<Completion>(base, COMPLETION_CAPACITY) };
    // SAFETY: the mapping outlives the consumer; the child attaches the only producer.
    let mut completions = unsafe { Consumer::<Completion>::attach(base, len) }.unwrap();

    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "a_million_records_cross_to_a_child_process_and_back_intact"])
        .args(["--test-threads", "1", "--quiet"])
        .env(CHILD_ENV, &object)
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn the child");

    let mut sent = 0u64;
    let mut answered = 0u64;
    let mut batch = Vec::new();
    let mut received = Vec::new();
    let mut batch_sizes_seen = [false; LARGEST_BATCH as usize + 1];
    let mut full_rings_seen = 0u64;
    while answered < RECORDS {
        let room = COMPLETION_CAPACITY as u64 - (sent - answered);
        let size = (splitmix(sent) % LARGEST_BATCH + 1).min(room).min(RECORDS - sent);
        let mut progressed = false;
        if size > 0 {
            batch.clear();
            batch.extend((sent..sent + size).map(command));
            if commands.push_all(&batch).is_ok() {
                batch_sizes_seen[size as usize] = true;
                sent += size;
                channel.commands_bell().ring();
                progressed = true;
            } else {
                full_rings_seen += 1;
            }
        }
        received.clear();
        completions.pop_into(&mut received, COMPLETION_CAPACITY).expect("sound completion ring");
        for completion in &received {
            assert!(completion.is_ok());
            assert_eq!(completion.command_id, answered, "completions arrive in command order");
            assert_eq!(completion.detail, command(answered).words[7], "checksum echoed");
            answered += 1;
        }
        if !progressed && received.is_empty() {
            let bell = channel.completions_bell();
            let mut ready = || !completions.is_empty().unwrap_or(true);
            let policy = WaitPolicy::new(Duration::from_micros(5), Duration::from_millis(20))
                .within(Duration::from_secs(1));
            if bell.wait_until(&mut ready, policy) == WaitOutcome::TimedOut {
                let status = child.try_wait().expect("query the child");
                assert!(status.is_none(), "child exited early with {status:?}");
            }
        }
    }
    let status = child.wait().expect("wait for the child");
    assert!(status.success(), "child failed: {status:?}");
    assert_eq!(completions.pop().unwrap(), None, "no completion beyond the last command");
    assert!(batch_sizes_seen[1] && batch_sizes_seen[LARGEST_BATCH as usize]);
    assert!(full_rings_seen > 0, "the command ring should have filled at least once");
}

fn run_child(object: &str) {
    let memory = SharedMemory::open(object).expect("open the parent's object");
    let channel = Channel { memory, layout: Layout::new() };
    let layout = &channel.layout;
    let (base, len) = channel.ring_memory(layout.commands, layout.completions);
    // SAFETY: the mapping outlives the consumer; the parent holds the only producer.
    let mut commands = unsafe { Consumer::<CommandSlot>::attach(base, len) }.unwrap();
    let (base, len) = channel.ring_memory(layout.completions, layout.len);
    // SAFETY: the mapping outlives the producer; the parent holds the only consumer.
    let mut completions = unsafe { Producer::<Completion>::attach(base, len) }.unwrap();
    let patience = Duration::from_secs(60);
    let mut expected = 0u64;
    let mut slots = Vec::new();
    let mut answers = Vec::new();
    while expected < RECORDS {
        wait_or_fail(
            channel.commands_bell(),
            || !commands.is_empty().unwrap_or(true),
            patience,
            "the parent stopped sending commands",
        );
        slots.clear();
        commands.pop_into(&mut slots, COMMAND_CAPACITY).expect("sound command ring");
        answers.clear();
        for slot in &slots {
            assert_eq!(slot.words[0], expected, "commands arrive in order");
            assert_eq!(*slot, command(expected), "payload arrives intact");
            assert_eq!(slot.words[7], checksum(&slot.words[..7]));
            let mut answer = Completion::ok(expected, 0);
            answer.detail = slot.words[7];
            answers.push(answer);
            expected += 1;
        }
        completions.push_all(&answers).expect("flow control leaves room for every completion");
        channel.completions_bell().ring();
    }
}

struct UnlinkOnDrop(String);

impl Drop for UnlinkOnDrop {
    fn drop(&mut self) {
        let _ = shm::unlink(&self.0);
    }
}
