//! The scheduler's side of one rank's rings, for the tests that drive `kvshm worker` processes
//! without a service: command ids, pushes that ring the worker's doorbell, and completions
//! waited for on the scheduler doorbell.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use kvshm_ipc::doorbell::WaitPolicy;
use kvshm_ipc::record::{encode_command, BlockPair, CommandHeader, CommandSlot, Completion, Op};
use kvshm_ipc::ring::{Consumer, Producer};
use kvshm_ipc::segment::{Mapped, Segment};
use kvshm_ipc::worker_slot::RankStatus;

/// Generous bound for anything a driver waits for; reaching it is a failure, not a measurement.
pub const RING_PATIENCE: Duration = Duration::from_secs(20);

/// A command as a test builds it: its header and block pairs.
pub type Command = (CommandHeader, Vec<BlockPair>);

/// The command producer and completion consumer of one rank, as the scheduler holds them.
pub struct RingDriver<'a> {
    pub segment: &'a Segment,
    pub rank: u32,
    commands: Mapped<Producer<CommandSlot>>,
    completions: Mapped<Consumer<Completion>>,
    next_id: u64,
}

impl<'a> RingDriver<'a> {
    pub fn new(segment: &'a Segment, rank: u32) -> RingDriver<'a> {
        RingDriver {
            segment,
            rank,
            commands: segment.command_producer(rank).unwrap(),
            completions: segment.completion_consumer(rank).unwrap(),
            next_id: 1,
        }
    }

    /// Fresh ring ends after the rank was reclaimed (its rings reset); command ids carry on.
    pub fn after_reclaim(self) -> RingDriver<'a> {
        RingDriver { next_id: self.next_id, ..RingDriver::new(self.segment, self.rank) }
    }

    /// A header for `op` with the next command id and the segment's current generation.
    pub fn header(&mut self, op: Op, pairs: u32) -> CommandHeader {
        let id = self.next_id;
        self.next_id += 1;
        CommandHeader::new(op, id, self.segment.generation(), pairs)
    }

    /// A copy (or FLUSH, PING) over `pairs` of (source, destination) blocks, not sent yet.
    pub fn copy(&mut self, op: Op, pairs: &[(u32, u32)]) -> Command {
        let pairs: Vec<BlockPair> = pairs.iter().map(|&(s, d)| BlockPair::new(s, d)).collect();
        (self.header(op, pairs.len() as u32), pairs)
    }

    pub fn ping(&mut self) -> Command {
        self.copy(Op::Ping, &[])
    }

    /// Queues `commands` with one push and rings the worker's doorbell.
    pub fn send<'c>(&mut self, commands: impl IntoIterator<Item = &'c Command>) {
        let mut slots = Vec::new();
        for (header, pairs) in commands {
            encode_command(header, pairs, &mut slots);
        }
        self.send_slots(&slots);
    }

    /// Pushes `slots` with one push and rings the worker's doorbell.
    pub fn send_slots(&mut self, slots: &[CommandSlot]) {
        self.commands.push_all(slots).expect("the command ring has room");
        self.segment.command_doorbell(self.rank).unwrap().ring();
    }

    /// Waits for `count` completions (at most [`RING_PATIENCE`]), in arrival order.
    pub fn completions(&mut self, count: usize) -> Vec<Completion> {
        let deadline = Instant::now() + RING_PATIENCE;
        let mut out = Vec::new();
        while out.len() < count {
            let missing = count - out.len();
            self.completions.pop_into(&mut out, missing).unwrap();
            if out.len() == count {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "only {} of {count} completions arrived: {out:?}",
                out.len()
            );
            let completions = &mut self.completions;
            self.segment.scheduler_doorbell().wait_until(
                || completions.len().unwrap() > 0,
                WaitPolicy::new(Duration::from_micros(5), Duration::from_millis(5))
                    .within(Duration::from_millis(50)),
            );
        }
        out
    }

    /// Pops whatever completions have arrived into `out`; whether there were any.
    pub fn try_completions(&mut self, out: &mut Vec<Completion>) -> bool {
        let before = out.len();
        self.completions.pop_into(out, usize::MAX).unwrap();
        out.len() > before
    }

    /// How many completions wait in the ring, not popped.
    pub fn waiting_completions(&mut self) -> usize {
        self.completions.len().unwrap()
    }

    /// Waits until the worker `pid` holds the rank (at most [`RING_PATIENCE`]).
    pub fn wait_alive(&self, pid: u32) {
        let deadline = Instant::now() + RING_PATIENCE;
        while self.segment.rank_status(self.rank).unwrap() != (RankStatus::Alive { pid }) {
            assert!(Instant::now() < deadline, "worker {pid} never claimed rank {}", self.rank);
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}
