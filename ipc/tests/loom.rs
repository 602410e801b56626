//! Loom models of the ring, the doorbell and the worker slot: every interleaving (up to
//! `LOOM_MAX_PREEMPTIONS` preemptions) of small programs over the production code.
//!
//! Run with:
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom cargo test -p kvshm-ipc --test loom --release`
//!
//! The heap ring under loom keeps its slots in loom cells, so a consumer reading a slot the
//! producer is still writing (or a producer overwriting a slot before the consumer released it)
//! fails the model, as does any record arriving out of order. The doorbell's futex model has no
//! timeouts: a lost wake-up leaves the waiter blocked forever, which loom reports as a deadlock.
//!
//! The worker-slot models give a rank's rings to a loom cell: a worker touches it while it holds
//! the claim, the scheduler's reset touches it inside a reclaim, and any two of these not ordered
//! by the protocol are a causality violation. The scheduler is the production [`WorkerWatch`];
//! model processes answer its liveness questions, and a process is seen gone only after its last
//! step (as a pidfd turns readable only after the process exited).
#![cfg(loom)]

use std::time::Duration;

use kvshm_ipc::doorbell::{Doorbell, WaitOutcome, WaitPolicy};
use kvshm_ipc::liveness::ProcessIdentity;
use kvshm_ipc::ring::{self, Consumer, Producer, RingFull};
use kvshm_ipc::worker_slot::{HeartbeatLimits, OwnerWord, RankStatus, WorkerSlot};
use kvshm_ipc::worker_watch::{Observation, Probed, ProcessProbe, WatchTiming, WorkerWatch};
use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;

/// Pops until `count` records arrived, yielding while the ring is empty.
fn pop_all(consumer: &mut Consumer<u64>, count: usize, batch: usize) -> Vec<u64> {
    let mut out = Vec::new();
    while out.len() < count {
        if consumer.pop_into(&mut out, batch).expect("a sound producer never corrupts the ring")
            == 0
        {
            thread::yield_now();
        }
    }
    out
}

/// Pushes `records` as one batch, yielding while the ring has no room for it.
fn push_batch(producer: &mut Producer<u64>, records: &[u64]) {
    while let Err(RingFull) = producer.push_all(records) {
        thread::yield_now();
    }
}

#[test]
fn batches_arrive_whole_and_in_order() {
    loom::model(|| {
        let (mut producer, mut consumer) = ring::heap::<u64>(4);
        let writer = thread::spawn(move || {
            push_batch(&mut producer, &[1, 2]);
            push_batch(&mut producer, &[3]);
        });
        let out = pop_all(&mut consumer, 3, 4);
        assert_eq!(out, [1, 2, 3]);
        writer.join().unwrap();
    });
}

#[test]
fn slots_are_reused_safely_when_a_ring_of_two_wraps() {
    loom::model(|| {
        let (mut producer, mut consumer) = ring::heap::<u64>(2);
        let writer = thread::spawn(move || {
            for record in 1..=4 {
                push_batch(&mut producer, &[record]);
            }
        });
        let mut out = Vec::new();
        while out.len() < 4 {
            match consumer.pop().expect("a sound producer never corrupts the ring") {
                Some(record) => out.push(record),
                None => thread::yield_now(),
            }
        }
        assert_eq!(out, [1, 2, 3, 4]);
        writer.join().unwrap();
    });
}

#[test]
fn a_consumer_polling_a_filling_ring_reads_only_published_slots() {
    loom::model(|| {
        let (mut producer, mut consumer) = ring::heap::<u64>(2);
        let writer = thread::spawn(move || {
            push_batch(&mut producer, &[7, 8]);
            push_batch(&mut producer, &[9]);
        });
        // Poll with a batch size of one while the producer fills and wraps the ring.
        let out = pop_all(&mut consumer, 3, 1);
        assert_eq!(out, [7, 8, 9]);
        writer.join().unwrap();
    });
}

/// Waits on the doorbell for at least one record, with no spinning so the futex path is taken.
fn wait_for_record(doorbell: &Doorbell, consumer: &mut Consumer<u64>) -> u64 {
    let policy = WaitPolicy::new(Duration::ZERO, Duration::from_secs(1));
    let outcome = doorbell.wait_until(
        || !consumer.is_empty().expect("a sound producer never corrupts the ring"),
        policy,
    );
    assert_eq!(outcome, WaitOutcome::Ready);
    consumer.pop().unwrap().expect("the waiter saw a published record")
}

#[test]
fn a_waiter_is_never_left_asleep_after_a_publish() {
    loom::model(|| {
        let doorbell = Arc::new(Doorbell::new());
        let (mut producer, mut consumer) = ring::heap::<u64>(2);
        let publisher = {
            let doorbell = doorbell.clone();
            thread::spawn(move || {
                producer.push(42).unwrap();
                doorbell.ring();
            })
        };
        assert_eq!(wait_for_record(&doorbell, &mut consumer), 42);
        publisher.join().unwrap();
    });
}

#[test]
fn a_waiter_is_never_left_asleep_across_two_rounds() {
    loom::model(|| {
        let doorbell = Arc::new(Doorbell::new());
        let (mut producer, mut consumer) = ring::heap::<u64>(2);
        let publisher = {
            let doorbell = doorbell.clone();
            thread::spawn(move || {
                for record in [1, 2] {
                    producer.push(record).unwrap();
                    doorbell.ring();
                }
            })
        };
        assert_eq!(wait_for_record(&doorbell, &mut consumer), 1);
        assert_eq!(wait_for_record(&doorbell, &mut consumer), 2);
        publisher.join().unwrap();
    });
}

#[test]
fn a_request_and_its_reply_never_strand_either_side() {
    loom::model(|| {
        let requests_bell = Arc::new(Doorbell::new());
        let replies_bell = Arc::new(Doorbell::new());
        let (mut requests, mut requests_in) = ring::heap::<u64>(1);
        let (mut replies, mut replies_in) = ring::heap::<u64>(1);
        let server = {
            let (requests_bell, replies_bell) = (requests_bell.clone(), replies_bell.clone());
            thread::spawn(move || {
                let request = wait_for_record(&requests_bell, &mut requests_in);
                replies.push(request + 1).unwrap();
                replies_bell.ring();
            })
        };
        requests.push(10).unwrap();
        requests_bell.ring();
        assert_eq!(wait_for_record(&replies_bell, &mut replies_in), 11);
        server.join().unwrap();
    });
}

// --- The worker slot: claim, release, heartbeat and reclaim, and the watch's fence ------------

/// A claimant's identity in the models (no such process is ever asked about: the models answer
/// liveness themselves).
fn model_identity(pid: u32) -> ProcessIdentity {
    ProcessIdentity::new(pid, 1)
}

/// The issue-7 race, on the slot's own operations: the worker W leaves (its last ring access, then
/// its release) while a successor Q claims and the scheduler S takes whatever slot it judges
/// unattended (every claimant lives, so only an empty or dead slot) and resets the rings under
/// its reclaim. A reset that overlaps a holder's ring access is a loom causality violation; a
/// claim taken from its holder fails the holder's heartbeat. A release in two steps (DEAD, then a
/// blind store of EMPTY) failed both ways here.
#[test]
fn a_reclaim_never_overlaps_a_departing_worker_or_wipes_its_successor() {
    loom::model(|| {
        let slot = Arc::new(WorkerSlot::new());
        let rings = Arc::new(UnsafeCell::new(0u64));
        let w_word = slot.claim(model_identity(1)).unwrap();
        let departing = {
            let (slot, rings) = (slot.clone(), rings.clone());
            thread::spawn(move || {
                // SAFETY: W holds the claim; loom checks that no reset overlaps this access.
                rings.with_mut(|pops| unsafe { *pops += 1 });
                slot.release(w_word);
            })
        };
        let successor = {
            let (slot, rings) = (slot.clone(), rings.clone());
            thread::spawn(move || {
                if let Ok(q_word) = slot.claim(model_identity(2)) {
                    // SAFETY: Q holds the claim; loom checks that no reset overlaps this access.
                    rings.with_mut(|pops| unsafe { *pops += 1 });
                    assert!(slot.heartbeat(q_word).is_ok(), "a reclaim took a live claim");
                }
            })
        };
        let verdict = slot.verdict(0, HeartbeatLimits::uniform(Duration::MAX), |_| true);
        if !matches!(verdict.status, RankStatus::Alive { .. }) {
            if let Ok(reclaim) = slot.begin_reclaim(verdict.word) {
                // SAFETY: the reclaim holds the slot DEAD; loom checks that no holder overlaps.
                rings.with_mut(|pops| unsafe { *pops = 0 });
                reclaim.finish().unwrap();
            }
        }
        departing.join().unwrap();
        successor.join().unwrap();
    });
}

/// A model process: alive until its thread ends; a kill asks it to stop at its next step.
#[derive(Default)]
struct ModelProcess {
    gone: AtomicBool,
    killed: AtomicBool,
}

impl ModelProcess {
    /// The end of the process's thread: everything it did happens before a probe sees it gone
    /// (as a pidfd turning readable orders a dead process's last writes).
    fn exit(&self) {
        // SYNC: pairs with the Acquire load in ModelProbe::is_alive().
        self.gone.store(true, Ordering::Release);
    }

    fn is_killed(&self) -> bool {
        // Relaxed: a request to stop; what it orders, exit() publishes.
        self.killed.load(Ordering::Relaxed)
    }
}

/// Answers the watch's process questions from the model processes (pids 1 and 2).
#[derive(Clone)]
struct ModelProbe {
    processes: Arc<[ModelProcess; 2]>,
}

impl ModelProbe {
    fn process(&self, pid: u32) -> &ModelProcess {
        &self.processes[pid as usize - 1]
    }
}

impl ProcessProbe for ModelProbe {
    type Handle = u32;

    fn open(&self, identity: ProcessIdentity) -> Probed<u32> {
        if self.is_alive(&identity.pid) {
            Probed::Worker(identity.pid)
        } else {
            Probed::Gone
        }
    }

    fn maps_segment(&self, pid: u32) -> Option<bool> {
        self.is_alive(&pid).then_some(true)
    }

    fn is_alive(&self, pid: &u32) -> bool {
        // SYNC: pairs with the Release store in ModelProcess::exit().
        !self.process(*pid).gone.load(Ordering::Acquire)
    }

    fn kill(&self, pid: &u32) -> Result<(), nix::errno::Errno> {
        self.process(*pid).killed.store(true, Ordering::Relaxed);
        Ok(())
    }

    fn is_self(&self, _: &u32) -> bool {
        false
    }
}

/// The scheduler's loop over one rank: observe, fence what must stop, reclaim (resetting the
/// rings) what is lost, until `done` says so.
fn schedule(
    watch: &mut WorkerWatch<ModelProbe>,
    slot: &WorkerSlot,
    rings: &UnsafeCell<u64>,
    now_ns: u64,
    mut done: impl FnMut(&Observation) -> bool,
) {
    loop {
        let observation = watch.observe(slot, now_ns);
        match observation {
            Observation::MustFence { .. } => {
                watch.fence();
            }
            Observation::Lost(lost) => {
                if let Ok(reclaim) = slot.begin_reclaim(lost.word()) {
                    // SAFETY: the watch judged every holder gone; loom checks the claim.
                    rings.with_mut(|pops| unsafe { *pops = 0 });
                    reclaim.finish().unwrap();
                    watch.forget();
                }
            }
            _ => {}
        }
        if done(&observation) {
            return;
        }
        thread::yield_now();
    }
}

/// A worker that marks itself serving, then heartbeats and pops, stopping when killed (SIGKILL: no release) or when it
/// lost its claim, releasing otherwise.
fn serve(slot: &WorkerSlot, rings: &UnsafeCell<u64>, me: &ModelProcess, word: OwnerWord) {
    // Setting up done: from now on the watch may call it serving.
    if me.is_killed() || slot.mark_serving(word).is_err() {
        me.exit();
        return;
    }
    for _ in 0..2 {
        if me.is_killed() || slot.heartbeat(word).is_err() {
            me.exit();
            return;
        }
        // SAFETY: the claim held at the heartbeat above; loom checks no reset overlaps.
        rings.with_mut(|pops| unsafe { *pops += 1 });
    }
    if !me.is_killed() {
        slot.release(word);
    }
    me.exit();
}

/// The fence: a worker judged stuck (every heartbeat counts as stale here), while it still sets up
/// or once it serves, is killed and its rank reclaimed only once it is gone, never under a ring
/// access it may still make.
#[test]
fn a_fenced_worker_is_gone_before_its_rings_are_reset() {
    loom::model(|| {
        let probe = ModelProbe { processes: Arc::new(Default::default()) };
        let slot = Arc::new(WorkerSlot::new());
        let rings = Arc::new(UnsafeCell::new(0u64));
        let timing = WatchTiming {
            heartbeat: HeartbeatLimits::uniform(Duration::ZERO),
            exit_grace: Duration::ZERO,
        };
        let mut watch = WorkerWatch::new(probe.clone(), timing);
        let word = slot.claim(model_identity(1)).unwrap();
        assert!(matches!(watch.observe(&slot, 0), Observation::Starting { pid: 1 }));
        let worker = {
            let (slot, rings, probe) = (slot.clone(), rings.clone(), probe.clone());
            thread::spawn(move || serve(&slot, &rings, probe.process(1), word))
        };
        schedule(&mut watch, &slot, &rings, u64::MAX, |observed| {
            matches!(observed, Observation::Lost(_))
        });
        worker.join().unwrap();
    });
}

/// The issue-7 race through the watch: W leaves cleanly while a successor Q claims and marks
/// itself serving, and the scheduler judges, fences and reclaims by the watch. No ring reset
/// overlaps W's or Q's ring accesses, and Q's claim is never taken while Q lives.
#[test]
fn a_clean_exit_racing_a_successor_and_the_watch_loses_no_live_claim() {
    loom::model(|| {
        let probe = ModelProbe { processes: Arc::new(Default::default()) };
        let slot = Arc::new(WorkerSlot::new());
        let rings = Arc::new(UnsafeCell::new(0u64));
        let timing = WatchTiming {
            heartbeat: HeartbeatLimits::uniform(Duration::MAX),
            exit_grace: Duration::ZERO,
        };
        let mut watch = WorkerWatch::new(probe.clone(), timing);
        let w_word = slot.claim(model_identity(1)).unwrap();
        slot.mark_serving(w_word).unwrap();
        assert!(matches!(watch.observe(&slot, 0), Observation::Alive { pid: 1, attached: true }));
        let departing = {
            let (slot, rings, probe) = (slot.clone(), rings.clone(), probe.clone());
            thread::spawn(move || {
                let me = probe.process(1);
                // SAFETY: W holds the claim; loom checks no reset overlaps this access.
                rings.with_mut(|pops| unsafe { *pops += 1 });
                if !me.is_killed() {
                    slot.release(w_word);
                }
                me.exit();
            })
        };
        let successor = {
            let (slot, rings, probe) = (slot.clone(), rings.clone(), probe.clone());
            thread::spawn(move || {
                let me = probe.process(2);
                if let Ok(q_word) = slot.claim(model_identity(2)) {
                    assert!(slot.mark_serving(q_word).is_ok(), "the scheduler took a live claim");
                    // SAFETY: Q holds the claim; loom checks no reset overlaps this access.
                    rings.with_mut(|pops| unsafe { *pops += 1 });
                    assert!(slot.heartbeat(q_word).is_ok(), "the scheduler took a live claim");
                }
                me.exit();
            })
        };
        // Until W is gone and the rank is either reclaimed or taken over by Q.
        schedule(&mut watch, &slot, &rings, 0, |observed| {
            matches!(observed, Observation::Lost(_) | Observation::Alive { pid: 2, .. })
        });
        departing.join().unwrap();
        successor.join().unwrap();
    });
}

/// The serving mark across a hand-over: W serves and leaves cleanly while a successor Q claims and
/// is still setting up (it never marks itself serving here). Whatever the interleaving, the watch
/// never calls Q serving on the strength of W's mark, never takes Q's claim while Q lives, and no
/// ring reset overlaps a ring access.
#[test]
fn a_predecessors_serving_mark_never_makes_a_starting_successor_serve() {
    loom::model(|| {
        let probe = ModelProbe { processes: Arc::new(Default::default()) };
        let slot = Arc::new(WorkerSlot::new());
        let rings = Arc::new(UnsafeCell::new(0u64));
        let timing = WatchTiming {
            heartbeat: HeartbeatLimits::uniform(Duration::MAX),
            exit_grace: Duration::ZERO,
        };
        let mut watch = WorkerWatch::new(probe.clone(), timing);
        let w_word = slot.claim(model_identity(1)).unwrap();
        slot.mark_serving(w_word).unwrap();
        assert!(matches!(watch.observe(&slot, 0), Observation::Alive { pid: 1, attached: true }));
        let departing = {
            let (slot, rings, probe) = (slot.clone(), rings.clone(), probe.clone());
            thread::spawn(move || {
                // SAFETY: W holds the claim; loom checks no reset overlaps this access.
                rings.with_mut(|pops| unsafe { *pops += 1 });
                slot.release(w_word);
                probe.process(1).exit();
            })
        };
        let successor = {
            let (slot, probe) = (slot.clone(), probe.clone());
            thread::spawn(move || {
                if let Ok(q_word) = slot.claim(model_identity(2)) {
                    assert!(slot.heartbeat(q_word).is_ok(), "the scheduler took a live claim");
                }
                probe.process(2).exit();
            })
        };
        schedule(&mut watch, &slot, &rings, 0, |observed| {
            assert!(
                !matches!(observed, Observation::Alive { pid: 2, .. }),
                "a successor that never marked itself was called serving"
            );
            matches!(observed, Observation::Lost(_) | Observation::Starting { pid: 2 })
        });
        departing.join().unwrap();
        successor.join().unwrap();
    });
}
