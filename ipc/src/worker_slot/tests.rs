//! The worker slot's state machine: single-threaded rules, one race forced step by step, and
//! claim/release cycles racing reclaims on real threads.

use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use super::*;
use crate::sync::{step_hook, AtomicBool, AtomicU64};

/// A pid above any pid_max: no such process exists.
const GHOST: ProcessIdentity = ProcessIdentity::new(2_000_000_000, 1);

fn now() -> u64 {
    monotonic_ns()
}

/// Reclaims `slot` from `judged` with nothing to reset, as the scheduler does.
fn reclaim(slot: &WorkerSlot, judged: OwnerWord) -> Result<(), ReclaimError> {
    slot.begin_reclaim(judged)?.finish()
}

#[test]
fn a_live_claim_is_alive_and_refuses_a_second_claim() {
    let slot = WorkerSlot::new();
    let me = ProcessIdentity::current();
    let word = slot.claim(me).unwrap();
    assert_eq!(slot.status(now(), HeartbeatLimits::DEFAULT), RankStatus::Alive { pid: me.pid });
    assert_eq!(slot.claim(me), Err(ClaimError::Occupied { pid: me.pid }));
    slot.heartbeat(word).unwrap();
    assert!(slot.release(word));
    assert_eq!(slot.status(now(), HeartbeatLimits::DEFAULT), RankStatus::Empty);
    assert_eq!(slot.view().attach_count, 1);
}

#[test]
fn every_transition_is_one_step_to_the_successor_word() {
    let slot = WorkerSlot::new();
    let me = ProcessIdentity::current();
    let claimed = slot.claim(me).unwrap();
    assert_eq!(
        (claimed.state(), claimed.pid(), claimed.version()),
        (WorkerState::Attached, me.pid, 1)
    );
    slot.release(claimed);
    let released = slot.owner();
    assert_eq!((released.state(), released.pid(), released.version()), (WorkerState::Empty, 0, 2));
    let reclaim = slot.begin_reclaim(released).unwrap();
    assert_eq!(reclaim.mark(), OwnerWord::new(WorkerState::Dead, 0, 3));
    reclaim.finish().unwrap();
    assert_eq!(slot.owner(), OwnerWord::new(WorkerState::Empty, 0, 4));
}

#[test]
fn the_fields_of_a_claim_belong_to_its_word_only() {
    let slot = WorkerSlot::new();
    let me = ProcessIdentity::current();
    let word = slot.claim(me).unwrap();
    let fields = slot.claim_fields(word).expect("a complete claim has its fields");
    assert_eq!(fields.start_time, me.start_time);
    assert!(fields.heartbeat_ns > 0 && fields.attached_at_ns > 0);
    slot.release(word);
    assert_eq!(slot.claim_fields(word), None, "a released claim's fields are not its any more");
    let next = slot.claim(me).unwrap();
    assert_eq!(slot.claim_fields(word), None);
    assert!(slot.claim_fields(next).is_some());
}

#[test]
fn a_stale_heartbeat_is_death_past_the_limit_of_the_workers_state() {
    let slot = WorkerSlot::new();
    let me = ProcessIdentity::current();
    let word = slot.claim(me).unwrap();
    let claimed = now();
    let past = |limit: Duration| claimed + limit.as_nanos() as u64 + 1_000_000;
    // Setting up: the serving limit is not enough to be judged dead, the set-up limit is.
    let limits = HeartbeatLimits::DEFAULT;
    assert_eq!(slot.status(past(HEARTBEAT_TIMEOUT), limits), RankStatus::Alive { pid: me.pid });
    assert_eq!(
        slot.status(past(SETUP_HEARTBEAT_TIMEOUT), limits),
        RankStatus::Dead { pid: me.pid }
    );
    // Serving: the serving limit.
    slot.mark_serving(word).unwrap();
    assert_eq!(slot.status(past(HEARTBEAT_TIMEOUT), limits), RankStatus::Dead { pid: me.pid });
}

/// A heartbeat written far in the future (by no worker: they write the monotonic clock) is as
/// stale as one far in the past; one a little ahead (written after the judge read the clock) is
/// fresh.
#[test]
fn a_heartbeat_far_in_the_future_is_stale_too() {
    let slot = WorkerSlot::new();
    let me = ProcessIdentity::current();
    let word = slot.claim(me).unwrap();
    slot.mark_serving(word).unwrap();
    let limits = HeartbeatLimits::DEFAULT;
    let judged = now();
    slot.overwrite_heartbeat(judged + 1_000_000);
    assert_eq!(slot.status(judged, limits), RankStatus::Alive { pid: me.pid });
    slot.overwrite_heartbeat(judged + 3_600 * 1_000_000_000);
    assert_eq!(slot.status(judged, limits), RankStatus::Dead { pid: me.pid });
    slot.overwrite_heartbeat(u64::MAX);
    assert_eq!(slot.status(judged, limits), RankStatus::Dead { pid: me.pid });
}

#[test]
fn a_dead_worker_blocks_claims_until_reclaimed() {
    let slot = WorkerSlot::new();
    let me = ProcessIdentity::current();
    let ghost_word = slot.claim(GHOST).unwrap();
    assert_eq!(slot.claim(me), Err(ClaimError::NotReclaimed { pid: GHOST.pid }));
    let verdict = slot.verdict(now(), HeartbeatLimits::DEFAULT, |id| id.is_alive());
    assert_eq!(verdict.status, RankStatus::Dead { pid: GHOST.pid });
    let reclaim = slot.begin_reclaim(verdict.word).unwrap();
    assert_eq!(slot.claim(me), Err(ClaimError::NotReclaimed { pid: GHOST.pid }));
    assert_eq!(
        slot.heartbeat(ghost_word),
        Err(ClaimLost { state: WorkerState::Dead, pid: GHOST.pid })
    );
    reclaim.finish().unwrap();
    slot.claim(me).unwrap();
    // The ghost's late release must not free the new worker's slot.
    assert!(!slot.release(ghost_word));
    assert_eq!(slot.status(now(), HeartbeatLimits::DEFAULT), RankStatus::Alive { pid: me.pid });
}

#[test]
fn a_late_release_by_the_same_pid_does_not_free_its_successors_claim() {
    // The same pid claims twice (a process that re-attaches, or a pid reused): only the version
    // tells the two claims apart.
    let slot = WorkerSlot::new();
    let me = ProcessIdentity::current();
    let first = slot.claim(me).unwrap();
    slot.release(first);
    let second = slot.claim(me).unwrap();
    assert!(!slot.release(first));
    assert_eq!(slot.owner(), second);
    assert!(slot.heartbeat(second).is_ok());
}

#[test]
fn a_reclaim_from_a_word_that_changed_since_it_was_judged_fails() {
    let slot = WorkerSlot::new();
    let me = ProcessIdentity::current();
    let judged = slot.owner();
    let word = slot.claim(me).unwrap();
    assert_eq!(
        slot.begin_reclaim(judged).unwrap_err(),
        ReclaimError::Changed { judged, found: word }
    );
    assert!(slot.heartbeat(word).is_ok());
}

#[test]
fn a_reclaim_whose_slot_was_written_meanwhile_does_not_finish() {
    let slot = WorkerSlot::new();
    let reclaim = slot.begin_reclaim(slot.owner()).unwrap();
    let scribble = OwnerWord::new(WorkerState::Attached, 42, 77);
    slot.overwrite_owner(scribble);
    assert!(
        matches!(reclaim.finish(), Err(ReclaimError::Changed { found, .. }) if found == scribble)
    );
    assert_eq!(slot.owner(), scribble);
}

#[test]
fn an_abandoned_reclaim_leaves_the_slot_unclaimable_until_reclaimed_again() {
    let slot = WorkerSlot::new();
    drop(slot.begin_reclaim(slot.owner()).unwrap());
    let dead = slot.owner();
    assert_eq!(dead.state(), WorkerState::Dead);
    assert!(matches!(slot.claim(ProcessIdentity::current()), Err(ClaimError::NotReclaimed { .. })));
    reclaim(&slot, dead).unwrap();
    slot.claim(ProcessIdentity::current()).unwrap();
}

/// The race of issue 7 forced step by step: the worker W is paused right after its release wrote
/// the owner word; the scheduler judges the slot and begins a reclaim; W resumes; a successor Q
/// claims; the scheduler finishes its reclaim. Q's claim must survive it. (With a release in two
/// steps, DEAD then a blind store of EMPTY, Q claimed between them and the finish wiped it.)
#[test]
fn a_release_paused_mid_reclaim_never_lets_the_reclaim_wipe_a_successors_claim() {
    let slot = Arc::new(WorkerSlot::new());
    let me = ProcessIdentity::current();
    let w_word = slot.claim(me).unwrap();
    let (paused_tx, paused) = mpsc::channel();
    let (resume, resume_rx) = mpsc::channel::<()>();
    let worker = {
        let slot = Arc::clone(&slot);
        thread::spawn(move || {
            step_hook::install(move |point| {
                if point == "release: owner word written" {
                    paused_tx.send(()).unwrap();
                    resume_rx.recv().unwrap();
                }
            });
            slot.release(w_word);
        })
    };
    paused.recv().unwrap();
    // The scheduler: W's word is gone from the slot, so whatever is there is judged and taken.
    let verdict = slot.verdict(now(), HeartbeatLimits::DEFAULT, |id| id.is_alive());
    let reclaim = (verdict.status != RankStatus::Alive { pid: me.pid })
        .then(|| slot.begin_reclaim(verdict.word).ok())
        .flatten();
    resume.send(()).unwrap();
    worker.join().unwrap();
    let successor = slot.claim(me);
    if let Some(reclaim) = reclaim {
        // The rings would be reset here: no claim may be live meanwhile.
        assert!(successor.is_err(), "a successor claimed the rank in the middle of a reclaim");
        reclaim.finish().unwrap();
    }
    if let Ok(q_word) = successor {
        assert!(slot.heartbeat(q_word).is_ok(), "the reclaim wiped the successor's live claim");
    }
    let q_word = slot.claim(me).or(successor).expect("the rank is claimable after the reclaim");
    assert!(slot.heartbeat(q_word).is_ok());
}

/// Claimants cycle claim, heartbeats, release as fast as they can while a reclaimer takes every
/// slot it judges unattended; a claim, once granted, must hold until its owner releases it, and
/// no claim may be live while a reclaim (which resets the rings) is. A release in two steps lost
/// a live claim within a few seconds here (~0.5 to 5 M cycles).
#[test]
fn claim_release_cycles_racing_reclaims_never_lose_a_live_claim() {
    const RUN_FOR: Duration = Duration::from_secs(3);
    let slot = Arc::new(WorkerSlot::new());
    let stop = Arc::new(AtomicBool::new(false));
    // Claims live now: raised after a claim succeeds, lowered before its release.
    let holding = Arc::new(AtomicU64::new(0));
    let me = ProcessIdentity::current();
    let claimants: Vec<_> = (0..2)
        .map(|_| {
            let (slot, stop, holding) =
                (Arc::clone(&slot), Arc::clone(&stop), Arc::clone(&holding));
            thread::spawn(move || {
                let (mut cycles, mut lost) = (0u64, 0u64);
                // Relaxed: the flag only ends the loop; join() orders the results.
                while !stop.load(Ordering::Relaxed) {
                    let Ok(word) = slot.claim(me) else { continue };
                    // SeqCst, here and below: the reclaimer's check must see every live claim.
                    holding.fetch_add(1, Ordering::SeqCst);
                    cycles += 1;
                    if (0..3).any(|_| slot.heartbeat(word).is_err()) {
                        lost += 1;
                    }
                    holding.fetch_sub(1, Ordering::SeqCst);
                    slot.release(word);
                }
                (cycles, lost)
            })
        })
        .collect();
    let reclaimer = {
        let (slot, stop, holding) = (Arc::clone(&slot), Arc::clone(&stop), Arc::clone(&holding));
        thread::spawn(move || {
            let (mut reclaims, mut overlapped) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                // Every claimant lives; only an empty (or dead) slot is judged unattended.
                let verdict =
                    slot.verdict(now(), HeartbeatLimits::uniform(Duration::MAX), |_| true);
                if matches!(verdict.status, RankStatus::Alive { .. }) {
                    continue;
                }
                let Ok(reclaim) = slot.begin_reclaim(verdict.word) else { continue };
                // The rings would be reset here.
                if holding.load(Ordering::SeqCst) != 0 {
                    overlapped += 1;
                }
                if reclaim.finish().is_ok() {
                    reclaims += 1;
                }
            }
            (reclaims, overlapped)
        })
    };
    let started = Instant::now();
    while started.elapsed() < RUN_FOR {
        thread::sleep(Duration::from_millis(10));
    }
    stop.store(true, Ordering::Relaxed);
    let (cycles, lost) = claimants
        .into_iter()
        .map(|claimant| claimant.join().unwrap())
        .fold((0, 0), |(c, l), (cycles, lost)| (c + cycles, l + lost));
    let (reclaims, overlapped) = reclaimer.join().unwrap();
    eprintln!("{cycles} claim/release cycles, {reclaims} reclaims");
    assert!(cycles > 0 && reclaims > 0, "both sides ran");
    assert_eq!(lost, 0, "a reclaim took a live claim");
    assert_eq!(overlapped, 0, "a reclaim ran while a claim was live");
}
