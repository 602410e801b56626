//! The scheduler's end of one rank: its ring ends, command ids, backlog and credits.
//!
//! A command leaves the scheduler in two steps:
//!
//! 1. [`RankChannel::queue`] encodes it and appends it to the backlog (it now has an id and is
//!    outstanding in the transport's command tracker);
//! 2. [`RankChannel::pump`] moves commands from the backlog into the command ring, as many as fit
//!    in one batch, publishing them with one Release, and rings the worker's doorbell.
//!
//! A worker answers the commands of one lane ([`Lane`]) in the order they entered the ring, so
//! the channel keeps, per lane, the ids in the ring not yet answered, oldest first; an answer
//! names where it stands among them ([`RankChannel::answered`]): one that overtook earlier
//! commands of its lane proves their answers lost, and one for a command not in the ring (never
//! issued, still in the backlog, answered already) is a stray.
//!
//! A command enters the ring only with a credit: the rank's completion ring holds
//! `completion_slots` records, and the channel never has more commands in the rings than that, so
//! a worker never finds its completion ring full. A completion gives its credit back (credits never
//! exceed `completion_slots`). Only a worker that answers commands it was never given can make
//! the scheduler issue more than the ring holds; that worker then waits for room, losing nothing.

use std::collections::VecDeque;

use kvshm_ipc::record::{encode_command, CommandHeader, CommandSlot, Completion};
use kvshm_ipc::ring::{Consumer, Producer, RingError};
use kvshm_ipc::segment::{Mapped, Segment, SegmentError};

/// Whether the rank has a worker that executes its commands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RankState {
    /// No worker has attached yet, or the last one died and the rank was reclaimed.
    Down,
    /// A live worker holds the rank but is still setting up (mapping its tiers, registering
    /// memory, opening its storage): commands for the rank wait in its backlog, for at most the
    /// command deadline (then they fail unsent, `super::deadline`).
    Starting { pid: u32 },
    /// A live worker holds the rank and serves its rings.
    Up { pid: u32 },
}

/// Which of a worker's two queues runs a command. A worker answers the commands of a lane in
/// ring order (its copy loop runs copies one by one; its storage thread, storage commands one by
/// one) and the two lanes in no order between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    Copy = 0,
    Storage = 1,
}

/// Where an answer to a command stands among the commands in the ring ([`RankChannel::answered`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Answered {
    /// The command was in the ring; `lost` are the commands of its lane that entered the ring
    /// before it and were never answered (their answers were lost), oldest first.
    InRing { lost: Vec<u64> },
    /// No such command is in the ring: never issued, still in the backlog, or answered already.
    NotInRing,
}

struct QueuedCommand {
    id: u64,
    lane: Lane,
    slots: Vec<CommandSlot>,
}

/// One rank as the scheduler sees it.
pub struct RankChannel {
    rank: u32,
    commands: Mapped<Producer<CommandSlot>>,
    completions: Mapped<Consumer<Completion>>,
    next_command_id: u64,
    backlog: VecDeque<QueuedCommand>,
    /// Per lane, the ids of the commands in the ring not yet answered, oldest first.
    in_ring: [VecDeque<u64>; 2],
    credits: usize,
    completion_slots: usize,
    state: RankState,
    /// The ring ends could not be taken afresh after a reclaim; they must be before the rank can
    /// come up again.
    stale_ends: bool,
    batch: Vec<CommandSlot>,
}

impl RankChannel {
    /// Takes the scheduler's ring ends of `rank`.
    pub fn open(segment: &Segment, rank: u32) -> Result<RankChannel, SegmentError> {
        let completion_slots = segment.config().completion_ring_slots as usize;
        Ok(RankChannel {
            rank,
            commands: segment.command_producer(rank)?,
            completions: segment.completion_consumer(rank)?,
            next_command_id: 1,
            backlog: VecDeque::new(),
            in_ring: [VecDeque::new(), VecDeque::new()],
            credits: completion_slots,
            completion_slots,
            state: RankState::Down,
            stale_ends: false,
            batch: Vec::new(),
        })
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    pub fn state(&self) -> RankState {
        self.state
    }

    /// A worker serves the rank: commands go into its ring.
    pub fn is_up(&self) -> bool {
        matches!(self.state, RankState::Up { .. })
    }

    /// No worker holds the rank: its transfers fail at once.
    pub fn is_down(&self) -> bool {
        self.state == RankState::Down
    }

    /// The rank has a live worker `pid` that serves (`state` Up) or still sets up (Starting).
    /// After a reclaim whose fresh ring ends could not be taken, they are taken now; if that
    /// still fails the rank stays down.
    pub fn set_worker(&mut self, segment: &Segment, state: RankState) -> Result<(), SegmentError> {
        debug_assert!(state != RankState::Down, "set_worker names a worker");
        if self.stale_ends {
            self.attach_ends(segment)?;
        }
        self.state = state;
        Ok(())
    }

    /// Commands queued and not yet moved into the command ring.
    pub fn backlog_len(&self) -> usize {
        self.backlog.len()
    }

    /// Commands in the rings (issued and not yet completed).
    pub fn in_rings(&self) -> usize {
        self.completion_slots - self.credits
    }

    /// Encodes a command for this rank, queues it and returns its id: a copy or a PING, which
    /// the worker answers in ring order with the copies. Not a FLUSH: a worker with a storage
    /// tier answers that in its storage lane, so its answer's place would not be this lane's.
    pub fn queue(&mut self, header: CommandHeader, pairs: &[kvshm_ipc::record::BlockPair]) -> u64 {
        debug_assert!(
            kvshm_ipc::record::Op::from_wire(header.op) != Some(kvshm_ipc::record::Op::Flush),
            "the scheduler issues no FLUSH: its lane depends on the worker's storage tier"
        );
        let command_id = self.next_command_id;
        self.next_command_id += 1;
        let mut header = header;
        header.command_id = command_id;
        let mut slots = Vec::new();
        encode_command(&header, pairs, &mut slots);
        self.backlog.push_back(QueuedCommand { id: command_id, lane: Lane::Copy, slots });
        command_id
    }

    /// Queues a storage command (STORE, LOAD or QUERY) of `entries` behind the others; returns
    /// its command id.
    pub fn queue_storage(
        &mut self,
        header: CommandHeader,
        entries: &[kvshm_ipc::storage_record::StorageEntry],
    ) -> u64 {
        let command_id = self.next_command_id;
        self.next_command_id += 1;
        let mut header = header;
        header.command_id = command_id;
        let mut slots = Vec::new();
        kvshm_ipc::storage_record::encode_storage_command(&header, entries, &mut slots);
        self.backlog.push_back(QueuedCommand { id: command_id, lane: Lane::Storage, slots });
        command_id
    }

    /// Moves as many queued commands as credits and ring space allow into the command ring, in
    /// one batch; returns how many it published.
    pub fn pump(&mut self) -> usize {
        if !self.is_up() {
            return 0;
        }
        let free_slots = self.commands.free_slots();
        self.batch.clear();
        let mut published = 0;
        while let Some(front) = self.backlog.front() {
            if self.credits == 0 || self.batch.len() + front.slots.len() > free_slots {
                break;
            }
            let command = self.backlog.pop_front().expect("front exists");
            self.batch.extend_from_slice(&command.slots);
            self.in_ring[command.lane as usize].push_back(command.id);
            self.credits -= 1;
            published += 1;
        }
        if published > 0 {
            self.commands
                .push_all(&self.batch)
                .expect("free_slots() said the batch fits, and only this side pushes");
        }
        published
    }

    /// The nonsensical head the worker's side of the command ring last showed, if it ever did: the
    /// ring can no longer tell which slots are free.
    pub fn command_ring_fault(&self) -> Option<RingError> {
        self.commands.consumer_fault()
    }

    /// Moves up to `max` completions into `out`; each returns a credit.
    pub fn reap(&mut self, out: &mut Vec<Completion>, max: usize) -> Result<usize, RingError> {
        let taken = self.completions.pop_into(out, max)?;
        // A worker that wrote more completions than commands it was given is broken; never let
        // credits exceed the ring.
        self.credits = (self.credits + taken).min(self.completion_slots);
        Ok(taken)
    }

    /// Drops every command of the backlog (none was sent) and returns their ids, oldest first.
    pub fn drop_backlog(&mut self) -> Vec<u64> {
        self.backlog.drain(..).map(|command| command.id).collect()
    }

    /// Takes command `id` out of the ring's unanswered commands, with the earlier ones of its
    /// lane, whose answers the worker can no longer give (module documentation).
    pub fn answered(&mut self, id: u64) -> Answered {
        for lane in &mut self.in_ring {
            if let Some(at) = lane.iter().position(|&command| command == id) {
                let lost = lane.drain(..at).collect();
                lane.pop_front();
                return Answered::InRing { lost };
            }
        }
        Answered::NotInRing
    }

    /// Whether completions are waiting (a corrupt ring counts as "yes" so that the caller reaps
    /// and sees the error).
    pub fn has_completions(&mut self) -> bool {
        !matches!(self.completions.is_empty(), Ok(true))
    }

    /// After the rank's worker died and the segment reclaimed the rank: the rank is down, its
    /// backlog and the ring's unanswered commands dropped and every credit restored, and it takes
    /// fresh ring ends (the old ones cache indices that no longer hold).
    ///
    /// # Errors
    ///
    /// The rings in shared memory no longer validate (a header written over): the rank stays down
    /// until [`set_worker`](Self::set_worker) manages to take fresh ends.
    pub fn reset_after_reclaim(&mut self, segment: &Segment) -> Result<(), SegmentError> {
        self.backlog.clear();
        self.in_ring.iter_mut().for_each(VecDeque::clear);
        self.credits = self.completion_slots;
        self.state = RankState::Down;
        self.stale_ends = true;
        self.attach_ends(segment)
    }

    fn attach_ends(&mut self, segment: &Segment) -> Result<(), SegmentError> {
        self.commands = segment.command_producer(self.rank)?;
        self.completions = segment.completion_consumer(self.rank)?;
        self.stale_ends = false;
        Ok(())
    }
}
