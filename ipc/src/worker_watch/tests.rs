//! The watch's decisions, with processes played by a table: who runs, who maps the segment, who
//! was signalled.

use std::cell::RefCell;
use std::collections::HashMap;

use super::*;
use crate::worker_slot::SETUP_HEARTBEAT_TIMEOUT;

const MS: u64 = 1_000_000;

#[derive(Clone, Copy)]
struct FakeProcess {
    start_time: u64,
    alive: bool,
    maps_segment: bool,
}

/// Processes by pid; a kill ends the process.
#[derive(Default)]
struct FakeProbe {
    processes: RefCell<HashMap<u32, FakeProcess>>,
    killed: RefCell<Vec<u32>>,
    me: u32,
}

impl FakeProbe {
    fn spawn(&self, pid: u32, maps_segment: bool) -> ProcessIdentity {
        let process = FakeProcess { start_time: 1_000 + u64::from(pid), alive: true, maps_segment };
        self.processes.borrow_mut().insert(pid, process);
        ProcessIdentity::new(pid, process.start_time)
    }

    fn exit(&self, pid: u32) {
        self.processes.borrow_mut().get_mut(&pid).unwrap().alive = false;
    }

    fn alive(&self, pid: u32) -> bool {
        self.processes.borrow().get(&pid).is_some_and(|process| process.alive)
    }
}

impl ProcessProbe for &FakeProbe {
    type Handle = ProcessIdentity;

    fn open(&self, identity: ProcessIdentity) -> Probed<ProcessIdentity> {
        match self.processes.borrow().get(&identity.pid) {
            Some(p) if p.alive && p.start_time == identity.start_time => {
                if p.maps_segment {
                    Probed::Worker(identity)
                } else {
                    Probed::Stranger
                }
            }
            _ => Probed::Gone,
        }
    }

    fn maps_segment(&self, pid: u32) -> Option<bool> {
        let processes = self.processes.borrow();
        processes.get(&pid).filter(|p| p.alive).map(|p| p.maps_segment)
    }

    fn is_alive(&self, handle: &ProcessIdentity) -> bool {
        let processes = self.processes.borrow();
        processes.get(&handle.pid).is_some_and(|p| p.alive && p.start_time == handle.start_time)
    }

    fn kill(&self, handle: &ProcessIdentity) -> Result<(), Errno> {
        self.killed.borrow_mut().push(handle.pid);
        if self.is_alive(handle) {
            self.exit(handle.pid);
        }
        Ok(())
    }

    fn is_self(&self, handle: &ProcessIdentity) -> bool {
        handle.pid == self.me
    }
}

fn watch(probe: &FakeProbe) -> WorkerWatch<&FakeProbe> {
    WorkerWatch::new(probe, WatchTiming::default())
}

/// A slot claimed by `identity`, whose worker serves, with its heartbeat at `heartbeat_ns`;
/// returns its word.
fn claimed(slot: &WorkerSlot, identity: ProcessIdentity, heartbeat_ns: u64) -> OwnerWord {
    let word = starting(slot, identity, heartbeat_ns);
    slot.mark_serving(word).unwrap();
    slot.overwrite_heartbeat(heartbeat_ns);
    word
}

/// As [`claimed`], with the worker still setting up (not marked serving).
fn starting(slot: &WorkerSlot, identity: ProcessIdentity, heartbeat_ns: u64) -> OwnerWord {
    let word = slot.claim(identity).unwrap();
    slot.overwrite_heartbeat(heartbeat_ns);
    word
}

fn lost(word: OwnerWord, worker: Option<u32>) -> Observation {
    Observation::Lost(LostRank { word, worker })
}

#[test]
fn a_worker_seen_attaching_is_recorded_and_judged_by_its_handle() {
    let probe = FakeProbe::default();
    let mut watch = watch(&probe);
    let slot = WorkerSlot::new();
    assert_eq!(watch.observe(&slot, 10 * MS), Observation::Empty);
    let worker = probe.spawn(100, true);
    let word = claimed(&slot, worker, 10 * MS);
    assert_eq!(watch.observe(&slot, 20 * MS), Observation::Alive { pid: 100, attached: true });
    assert_eq!(watch.observe(&slot, 30 * MS), Observation::Alive { pid: 100, attached: false });
    probe.exit(100);
    assert_eq!(watch.observe(&slot, 40 * MS), lost(word, Some(100)));
}

#[test]
fn a_worker_still_setting_up_is_starting_until_it_marks_itself_serving() {
    let probe = FakeProbe::default();
    let mut watch = watch(&probe);
    let slot = WorkerSlot::new();
    let word = starting(&slot, probe.spawn(100, true), 10 * MS);
    assert_eq!(watch.observe(&slot, 20 * MS), Observation::Starting { pid: 100 });
    assert_eq!(watch.recorded_pid(), Some(100));
    assert_eq!(watch.observe(&slot, 30 * MS), Observation::Starting { pid: 100 });
    assert!(!slot.view().serving);
    slot.mark_serving(word).unwrap();
    slot.overwrite_heartbeat(40 * MS);
    assert!(slot.view().serving);
    assert_eq!(watch.observe(&slot, 50 * MS), Observation::Alive { pid: 100, attached: false });
}

#[test]
fn a_worker_that_stops_heartbeating_while_setting_up_is_fenced() {
    let probe = FakeProbe::default();
    let mut watch = watch(&probe);
    let slot = WorkerSlot::new();
    starting(&slot, probe.spawn(100, true), 10 * MS);
    assert_eq!(watch.observe(&slot, 20 * MS), Observation::Starting { pid: 100 });
    // A step of a set-up may take longer than a serving worker's limit...
    let serving_limit = HEARTBEAT_TIMEOUT.as_nanos() as u64;
    let setup_limit = SETUP_HEARTBEAT_TIMEOUT.as_nanos() as u64;
    assert_eq!(
        watch.observe(&slot, 10 * MS + 2 * serving_limit),
        Observation::Starting { pid: 100 }
    );
    // ...but no step for the set-up limit gets the worker fenced.
    assert!(matches!(
        watch.observe(&slot, 10 * MS + setup_limit + MS),
        Observation::MustFence { pid: 100, reason: FenceReason::HeartbeatStale { .. } }
    ));
}

#[test]
fn a_predecessors_serving_mark_never_makes_its_successor_serving() {
    let probe = FakeProbe::default();
    let mut watch = watch(&probe);
    let slot = WorkerSlot::new();
    let word = claimed(&slot, probe.spawn(100, true), 10 * MS);
    watch.observe(&slot, 10 * MS);
    slot.release(word);
    probe.exit(100);
    let successor = starting(&slot, probe.spawn(101, true), 15 * MS);
    assert_eq!(watch.observe(&slot, 20 * MS), Observation::Starting { pid: 101 });
    // A mark stored by a claim that lost its slot names that claim only.
    assert!(slot.mark_serving(word).is_err());
    assert_eq!(watch.observe(&slot, 25 * MS), Observation::Starting { pid: 101 });
    slot.mark_serving(successor).unwrap();
    slot.overwrite_heartbeat(30 * MS);
    assert_eq!(watch.observe(&slot, 30 * MS), Observation::Alive { pid: 101, attached: false });
}

#[test]
fn a_stale_heartbeat_asks_for_a_fence_and_the_fence_reaches_the_recorded_process_only() {
    let probe = FakeProbe::default();
    let mut watch = watch(&probe);
    let slot = WorkerSlot::new();
    let worker = probe.spawn(100, true);
    let word = claimed(&slot, worker, 10 * MS);
    watch.observe(&slot, 10 * MS);
    let observed = watch.observe(&slot, 500 * MS);
    assert!(matches!(
        observed,
        Observation::MustFence { pid: 100, reason: FenceReason::HeartbeatStale { .. } }
    ));
    // Whatever the slot says by now, the fence signals the process recorded at attach.
    slot.overwrite_owner(OwnerWord::new(WorkerState::Attached, 200, 9));
    probe.spawn(200, false);
    assert_eq!(watch.fence(), FenceOutcome::Signalled { pid: 100 });
    assert_eq!(*probe.killed.borrow(), [100]);
    assert!(probe.alive(200));
    let scribbled = slot.owner();
    assert_eq!(watch.observe(&slot, 510 * MS), lost(scribbled, Some(100)));
    let _ = word;
}

#[test]
fn a_slot_marked_dead_while_its_worker_runs_loses_nothing_until_the_worker_is_gone() {
    let probe = FakeProbe::default();
    let mut watch = watch(&probe);
    let slot = WorkerSlot::new();
    claimed(&slot, probe.spawn(100, true), 10 * MS);
    watch.observe(&slot, 10 * MS);
    for scribble in [
        OwnerWord::new(WorkerState::Dead, 100, 5),
        OwnerWord::from_raw(u64::MAX),
        OwnerWord::new(WorkerState::Attached, 100, 99),
    ] {
        slot.overwrite_owner(scribble);
        for now in [11 * MS, 50 * MS, 10_000 * MS] {
            let observed = watch.observe(&slot, now);
            assert!(
                matches!(
                    observed,
                    Observation::MustFence { pid: 100, .. } | Observation::Waiting { pid: 100 }
                ),
                "{scribble:?} at {now}: {observed:?}"
            );
        }
    }
    assert!(probe.killed.borrow().is_empty(), "observing signals nobody");
    watch.fence();
    let now_says = slot.owner();
    assert_eq!(watch.observe(&slot, 10_001 * MS), lost(now_says, Some(100)));
}

#[test]
fn a_worker_that_let_go_of_its_slot_gets_a_grace_to_exit_then_a_fence() {
    let probe = FakeProbe::default();
    let mut watch = watch(&probe);
    let slot = WorkerSlot::new();
    let word = claimed(&slot, probe.spawn(100, true), 10 * MS);
    watch.observe(&slot, 10 * MS);
    assert!(slot.release(word));
    assert_eq!(watch.observe(&slot, 20 * MS), Observation::Waiting { pid: 100 });
    assert_eq!(watch.observe(&slot, 100 * MS), Observation::Waiting { pid: 100 });
    let released = slot.owner();
    assert_eq!(
        watch.observe(&slot, 200 * MS),
        Observation::MustFence { pid: 100, reason: FenceReason::DidNotExit { slot: released } }
    );
    probe.exit(100);
    assert_eq!(watch.observe(&slot, 210 * MS), lost(released, Some(100)));
}

#[test]
fn a_successor_that_claims_after_a_clean_exit_takes_over_without_a_loss() {
    let probe = FakeProbe::default();
    let mut watch = watch(&probe);
    let slot = WorkerSlot::new();
    let word = claimed(&slot, probe.spawn(100, true), 10 * MS);
    watch.observe(&slot, 10 * MS);
    slot.release(word);
    let successor = claimed(&slot, probe.spawn(101, true), 15 * MS);
    // The first worker is still exiting: nothing changes hands before it is gone.
    assert_eq!(watch.observe(&slot, 20 * MS), Observation::Waiting { pid: 100 });
    probe.exit(100);
    assert_eq!(watch.observe(&slot, 30 * MS), Observation::Alive { pid: 101, attached: true });
    assert_eq!(watch.recorded_pid(), Some(101));
    assert_eq!(slot.owner(), successor);
}

#[test]
fn a_claim_naming_a_process_that_does_not_map_the_segment_is_never_recorded_or_signalled() {
    let probe = FakeProbe::default();
    let mut watch = watch(&probe);
    let slot = WorkerSlot::new();
    let stranger = probe.spawn(300, false);
    let forged = claimed(&slot, stranger, 10 * MS);
    assert_eq!(watch.observe(&slot, 10 * MS), lost(forged, None));
    assert_eq!(watch.recorded_pid(), None);
    assert_eq!(watch.fence(), FenceOutcome::Gone);
    let _ = watch.observe(&slot, 10_000 * MS);
    assert!(probe.killed.borrow().is_empty());
    assert!(probe.alive(300));
}

#[test]
fn a_claim_still_being_set_up_is_waited_for_while_its_process_lives() {
    let probe = FakeProbe::default();
    let mut watch = watch(&probe);
    let slot = WorkerSlot::new();
    probe.spawn(100, true);
    // The claimant's CAS landed, its fields not yet.
    let word = OwnerWord::new(WorkerState::Attached, 100, 1);
    slot.overwrite_owner(word);
    assert_eq!(watch.observe(&slot, 10 * MS), Observation::Waiting { pid: 100 });
    probe.exit(100);
    assert_eq!(watch.observe(&slot, 20 * MS), lost(word, None));
    // A stranger's pid with no fields is not waited for either.
    probe.spawn(300, false);
    let forged = OwnerWord::new(WorkerState::Attached, 300, 1);
    slot.overwrite_owner(forged);
    assert_eq!(watch.observe(&slot, 30 * MS), lost(forged, None));
}

#[test]
fn a_claim_whose_process_started_at_another_time_is_a_dead_claim() {
    let probe = FakeProbe::default();
    let mut watch = watch(&probe);
    let slot = WorkerSlot::new();
    let real = probe.spawn(100, true);
    let word = claimed(&slot, ProcessIdentity::new(real.pid, real.start_time + 1), 10 * MS);
    assert_eq!(watch.observe(&slot, 10 * MS), lost(word, None));
}

#[test]
fn this_process_playing_a_worker_is_never_signalled_and_counts_as_gone_once_fenced() {
    let probe = FakeProbe { me: 100, ..FakeProbe::default() };
    let mut watch = watch(&probe);
    let slot = WorkerSlot::new();
    let word = claimed(&slot, probe.spawn(100, true), 10 * MS);
    assert_eq!(watch.observe(&slot, 10 * MS), Observation::Alive { pid: 100, attached: true });
    assert_eq!(watch.fence(), FenceOutcome::Gone);
    assert!(probe.killed.borrow().is_empty());
    assert_eq!(watch.observe(&slot, 11 * MS), lost(word, Some(100)));
    // Letting go of the slot counts as gone at once, without a grace.
    watch.forget();
    slot.begin_reclaim(word).unwrap().finish().unwrap();
    let again = claimed(&slot, ProcessIdentity::new(100, 1_100), 20 * MS);
    watch.observe(&slot, 20 * MS);
    slot.release(again);
    assert_eq!(watch.observe(&slot, 21 * MS), lost(slot.owner(), Some(100)));
}
