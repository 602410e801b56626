//! Requests from `kvctl` that the scheduler carries out in its poll: reset and tree snapshot.
//!
//! [`ControlArea`] lives in the control segment; [`Control`] is a view of it together with the
//! snapshot byte area ([`SNAPSHOT_BYTES`]). Several kvctl processes may race, so a request is
//! claimed with a CAS on a request word `(sequence << 32) | argument`, and only while no request is
//! pending (request sequence == done sequence); a loser sees [`ControlError::Busy`] and retries
//! (the blocking helpers [`Control::reset`] and [`Control::fetch_snapshot`] do so until a deadline).
//!
//! Reset:
//! 1. kvctl CASes `reset_request` to `(seq + 1, force)`;
//! 2. the scheduler's poll sees [`Control::pending_reset`], carries it out, and stores
//!    `reset_done = (seq, status)` with Release ([`Control::complete_reset`]);
//! 3. kvctl waits until `reset_done` carries its sequence and reads the status.
//!
//! Snapshot:
//! 1. kvctl CASes `snapshot_request` to `(seq + 1, depth)`, or joins a pending request of the same
//!    depth;
//! 2. the scheduler writes the JSON, its length and `(seq, depth)` under a seqlock
//!    ([`Control::publish_snapshot`]);
//! 3. kvctl reads them under the seqlock and retries a torn copy.

use std::time::{Duration, Instant};

use thiserror::Error;

use crate::doorbell::deadline_after;
use crate::seqlock::{self, SeqLockBusy};
use crate::sync::{AtomicU64, Ordering};

/// Bytes of the tree-snapshot area.
pub const SNAPSHOT_BYTES: usize = 1 << 20;
/// Words (u64) of the tree-snapshot area.
pub const SNAPSHOT_WORDS: usize = SNAPSHOT_BYTES / 8;
/// Snapshot depth meaning "the whole tree".
pub const DEPTH_UNLIMITED: u32 = u32::MAX;

/// Answered resets whose status stays readable: a client still reads its own answer after this
/// many later resets were answered (kvctl clients poll every millisecond, so only a client stalled
/// through hundreds of other resets sees `Overtaken`).
pub const RESET_HISTORY: usize = 256;

const SNAPSHOT_OK: u64 = 0;
const SNAPSHOT_TOO_LARGE: u64 = 1;

/// The control words as they lie in the segment. Zeroed memory means "no request ever made".
/// Every field is an atomic: kvctl processes and the scheduler write them at any time.
#[repr(C, align(64))]
pub struct ControlArea {
    /// `(seq << 32) | force`, claimed by kvctl.
    reset_request: AtomicU64,
    /// `(seq << 32) | status`, stored by the scheduler.
    reset_done: AtomicU64,
    /// `(seq << 32) | status` of the last [`RESET_HISTORY`] resets, at `seq % RESET_HISTORY`, so
    /// that a client still gets its status after another client's request followed.
    reset_history: [AtomicU64; RESET_HISTORY],
    _reserved0: [AtomicU64; 6],
    /// `(seq << 32) | depth`, claimed by kvctl.
    snapshot_request: AtomicU64,
    /// Seqlock version of the snapshot header words and bytes.
    snapshot_version: AtomicU64,
    /// Under the seqlock: `(seq << 32) | depth`, byte length, status.
    snapshot_header: [AtomicU64; 3],
    /// The snapshot seqlock's writer word (the scheduler while it publishes; 0: none).
    snapshot_writer: AtomicU64,
    _reserved1: [AtomicU64; 2],
}

const _: () = assert!(size_of::<ControlArea>() == 2_176);
const _: () = assert!(size_of::<ControlArea>() == (RESET_HISTORY + 16) * size_of::<AtomicU64>());

// SAFETY: AtomicU64 fields only, with no padding (asserted above); any bits are a valid area (a
// request word is checked against the done word, a snapshot under its seqlock).
unsafe impl crate::shm::SharedArea for ControlArea {}

/// How a reset ended, as reported by the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResetStatus {
    /// The cache was emptied and the generation bumped.
    Done,
    /// Refused without `--force`: requests are live or commands are in flight.
    RefusedBusy,
    /// The scheduler tried and failed.
    Failed,
}

impl ResetStatus {
    pub fn to_wire(self) -> u32 {
        match self {
            ResetStatus::Done => 1,
            ResetStatus::RefusedBusy => 2,
            ResetStatus::Failed => 3,
        }
    }

    pub fn from_wire(code: u32) -> Option<ResetStatus> {
        match code {
            1 => Some(ResetStatus::Done),
            2 => Some(ResetStatus::RefusedBusy),
            3 => Some(ResetStatus::Failed),
            _ => None,
        }
    }
}

/// A reset the scheduler has to carry out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResetRequest {
    pub seq: u32,
    pub force: bool,
}

/// A snapshot the scheduler has to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotRequest {
    pub seq: u32,
    /// Levels below the root to include; [`DEPTH_UNLIMITED`] for all.
    pub depth: u32,
}

/// Why a kvctl request did not produce a result.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ControlError {
    #[error("another request is pending; retry")]
    Busy,
    #[error("the scheduler did not answer within {0:?} (is it running and polling?)")]
    TimedOut(Duration),
    #[error("a later request replaced this one before its result was read")]
    Overtaken,
    #[error("the scheduler answered with unknown status code {0}")]
    UnknownStatus(u32),
    #[error("the tree snapshot of {len} bytes does not fit the {max}-byte snapshot area")]
    SnapshotTooLarge { len: u64, max: usize },
    #[error("the tree snapshot is not valid UTF-8")]
    NotUtf8,
}

/// Why the scheduler's snapshot was not published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum PublishSnapshotError {
    /// The JSON does not fit [`SNAPSHOT_BYTES`]; kvctl is told its size instead.
    #[error("snapshot of {len} bytes exceeds the {SNAPSHOT_BYTES}-byte snapshot area")]
    TooLarge { len: usize },
    /// The snapshot seqlock is held by another live process, although the scheduler is its only
    /// writer: something else wrote the segment. Nothing was published; kvctl's request times
    /// out. (A lock left by a dead process is taken over, not reported.)
    #[error(
        "the snapshot area's lock is held by process {pid}, not this scheduler; nothing published"
    )]
    AreaLocked { pid: u32 },
}

/// A view of the control area and the snapshot bytes of one mapped segment.
#[derive(Clone, Copy)]
pub struct Control<'a> {
    area: &'a ControlArea,
    snapshot: &'a [AtomicU64],
}

fn pack(seq: u32, argument: u32) -> u64 {
    (u64::from(seq) << 32) | u64::from(argument)
}

fn unpack(word: u64) -> (u32, u32) {
    ((word >> 32) as u32, word as u32)
}

/// Polling interval of the blocking helpers: kvctl is interactive, the scheduler polls often.
const POLL_INTERVAL: Duration = Duration::from_millis(1);

impl<'a> Control<'a> {
    /// # Panics
    /// If `snapshot` is not [`SNAPSHOT_WORDS`] long: the segment layout guarantees it, so this is
    /// a programming error.
    pub(crate) fn new(area: &'a ControlArea, snapshot: &'a [AtomicU64]) -> Self {
        assert_eq!(snapshot.len(), SNAPSHOT_WORDS, "snapshot area size is a programming error");
        Control { area, snapshot }
    }

    // ----- reset, kvctl side -----

    /// Claims a reset request; returns its sequence number, or `Busy` while another is pending.
    pub fn request_reset(&self, force: bool) -> Result<u32, ControlError> {
        // SYNC: pairs with the Release store of reset_done in complete_reset().
        let done = unpack(self.area.reset_done.load(Ordering::Acquire)).0;
        let request = self.area.reset_request.load(Ordering::Relaxed);
        let (seq, _) = unpack(request);
        if seq != done {
            return Err(ControlError::Busy);
        }
        let mine = seq.wrapping_add(1);
        // SYNC: the Release half publishes the request to the Acquire load in pending_reset().
        self.area
            .reset_request
            .compare_exchange(
                request,
                pack(mine, u32::from(force)),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .map(|_| mine)
            .map_err(|_| ControlError::Busy)
    }

    /// The status of reset `seq` once the scheduler has answered it; `Overtaken` once more than
    /// [`RESET_HISTORY`] later resets were answered before this was asked.
    pub fn reset_outcome(&self, seq: u32) -> Option<Result<ResetStatus, ControlError>> {
        let entry = &self.area.reset_history[seq as usize % RESET_HISTORY];
        let answered = || {
            // SYNC: pairs with the Release store of the history entry in complete_reset().
            let (answered, status) = unpack(entry.load(Ordering::Acquire));
            (answered == seq)
                .then(|| ResetStatus::from_wire(status).ok_or(ControlError::UnknownStatus(status)))
        };
        if let Some(outcome) = answered() {
            return Some(outcome);
        }
        // SYNC: pairs with the Release half of a later client's CAS in request_reset(); that
        // client had seen our answer (Acquire of reset_done), so the re-check below sees it too.
        let (requested, _) = unpack(self.area.reset_request.load(Ordering::Acquire));
        if requested == seq {
            return None;
        }
        Some(answered().unwrap_or(Err(ControlError::Overtaken)))
    }

    /// Requests a reset (retrying while another request is pending) and waits for its status.
    pub fn reset(&self, force: bool, timeout: Duration) -> Result<ResetStatus, ControlError> {
        let deadline = deadline_after(timeout);
        let seq = retry_until(deadline, timeout, || self.request_reset(force))?;
        retry_until(deadline, timeout, || {
            self.reset_outcome(seq).unwrap_or(Err(ControlError::Busy))
        })
    }

    // ----- reset, scheduler side -----

    /// The reset kvctl asked for, if one is pending.
    pub fn pending_reset(&self) -> Option<ResetRequest> {
        // Relaxed: the request word is the whole message; the client writes nothing before it
        // that the scheduler reads.
        let (seq, force) = unpack(self.area.reset_request.load(Ordering::Relaxed));
        let (done, _) = unpack(self.area.reset_done.load(Ordering::Relaxed));
        (seq != done).then_some(ResetRequest { seq, force: force != 0 })
    }

    /// Answers `request` with `status`.
    pub fn complete_reset(&self, request: ResetRequest, status: ResetStatus) {
        let answer = pack(request.seq, status.to_wire());
        // SYNC: pairs with the Acquire load of the history entry in reset_outcome().
        self.area.reset_history[request.seq as usize % RESET_HISTORY]
            .store(answer, Ordering::Release);
        // SYNC: pairs with the Acquire load of reset_done in request_reset().
        self.area.reset_done.store(answer, Ordering::Release);
    }

    // ----- snapshot, kvctl side -----

    /// Claims a snapshot request of `depth`, or joins a pending one of the same depth.
    pub fn request_snapshot(&self, depth: u32) -> Result<u32, ControlError> {
        let done = self.snapshot_done_seq();
        let request = self.area.snapshot_request.load(Ordering::Relaxed);
        let (seq, pending_depth) = unpack(request);
        if seq != done {
            return if pending_depth == depth { Ok(seq) } else { Err(ControlError::Busy) };
        }
        let mine = seq.wrapping_add(1);
        // Relaxed: the request word is the whole message (sequence and depth); nothing is
        // published behind it.
        self.area
            .snapshot_request
            .compare_exchange(request, pack(mine, depth), Ordering::Relaxed, Ordering::Relaxed)
            .map(|_| mine)
            .map_err(|_| ControlError::Busy)
    }

    /// The JSON of snapshot `seq`, once published; `Busy` while not yet there or being rewritten.
    pub fn read_snapshot(&self, seq: u32) -> Result<Vec<u8>, ControlError> {
        let (header, bytes) = seqlock::read(
            &self.area.snapshot_version,
            &self.area.snapshot_header,
            self.snapshot,
            |header| if unpack(header[0]).0 == seq { header[1] as usize } else { 0 },
        )
        .map_err(|SeqLockBusy| ControlError::Busy)?;
        let (done, _) = unpack(header[0]);
        if done != seq {
            let (requested, _) = unpack(self.area.snapshot_request.load(Ordering::Relaxed));
            return Err(if requested == seq {
                ControlError::Busy
            } else {
                ControlError::Overtaken
            });
        }
        match header[2] {
            SNAPSHOT_OK => Ok(bytes),
            SNAPSHOT_TOO_LARGE => {
                Err(ControlError::SnapshotTooLarge { len: header[1], max: SNAPSHOT_BYTES })
            }
            status => Err(ControlError::UnknownStatus(status as u32)),
        }
    }

    /// Requests a snapshot of `depth` and waits for its JSON text (retrying races until `timeout`).
    pub fn fetch_snapshot(&self, depth: u32, timeout: Duration) -> Result<String, ControlError> {
        let deadline = deadline_after(timeout);
        let bytes = retry_until(deadline, timeout, || {
            let seq = self.request_snapshot(depth)?;
            // Wait for this request; a later one overtaking it sends us back to claiming.
            loop {
                match self.read_snapshot(seq) {
                    Err(ControlError::Busy) if Instant::now() < deadline => {
                        std::thread::sleep(POLL_INTERVAL)
                    }
                    Err(ControlError::Overtaken) => return Err(ControlError::Busy),
                    other => return other,
                }
            }
        })?;
        String::from_utf8(bytes).map_err(|_| ControlError::NotUtf8)
    }

    // ----- snapshot, scheduler side -----

    /// The snapshot kvctl asked for, if one is pending.
    pub fn pending_snapshot(&self) -> Option<SnapshotRequest> {
        // Relaxed: the request word is the whole message (see request_snapshot()).
        let (seq, depth) = unpack(self.area.snapshot_request.load(Ordering::Relaxed));
        (seq != self.snapshot_done_seq()).then_some(SnapshotRequest { seq, depth })
    }

    /// Publishes `json` as the answer to `request`. JSON longer than [`SNAPSHOT_BYTES`] is not
    /// written; kvctl is told its size instead, and the error is returned too.
    ///
    /// # Errors
    ///
    /// [`PublishSnapshotError::TooLarge`] as said; [`PublishSnapshotError::AreaLocked`] when the
    /// seqlock's writer word names another live process, which only corruption can cause.
    pub fn publish_snapshot(
        &self,
        request: SnapshotRequest,
        json: &[u8],
    ) -> Result<(), PublishSnapshotError> {
        let too_large = json.len() > SNAPSHOT_BYTES;
        let status = if too_large { SNAPSHOT_TOO_LARGE } else { SNAPSHOT_OK };
        let header = [pack(request.seq, request.depth), json.len() as u64, status];
        let body = if too_large { &[][..] } else { json };
        seqlock::write(
            &self.area.snapshot_version,
            &self.area.snapshot_writer,
            &self.area.snapshot_header,
            &header,
            self.snapshot,
            body,
        )
        .map_err(|SeqLockBusy| {
            // Relaxed: only names the holder in the error.
            let held = self.area.snapshot_writer.load(Ordering::Relaxed);
            PublishSnapshotError::AreaLocked { pid: held as u32 }
        })?;
        if too_large {
            Err(PublishSnapshotError::TooLarge { len: json.len() })
        } else {
            Ok(())
        }
    }

    fn snapshot_done_seq(&self) -> u32 {
        // SYNC: pairs with the Release store of the version in seqlock::write() (publish_snapshot).
        let _ = self.area.snapshot_version.load(Ordering::Acquire);
        unpack(self.area.snapshot_header[0].load(Ordering::Relaxed)).0
    }
}

fn retry_until<T>(
    deadline: Instant,
    timeout: Duration,
    mut attempt: impl FnMut() -> Result<T, ControlError>,
) -> Result<T, ControlError> {
    loop {
        match attempt() {
            Err(ControlError::Busy) if Instant::now() < deadline => {
                std::thread::sleep(POLL_INTERVAL)
            }
            Err(ControlError::Busy) => return Err(ControlError::TimedOut(timeout)),
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Heap {
        area: Box<ControlArea>,
        snapshot: Vec<AtomicU64>,
    }

    fn heap() -> Heap {
        Heap {
            area: Box::new(ControlArea {
                reset_request: AtomicU64::new(0),
                reset_done: AtomicU64::new(0),
                reset_history: std::array::from_fn(|_| AtomicU64::new(0)),
                _reserved0: std::array::from_fn(|_| AtomicU64::new(0)),
                snapshot_request: AtomicU64::new(0),
                snapshot_version: AtomicU64::new(0),
                snapshot_header: std::array::from_fn(|_| AtomicU64::new(0)),
                snapshot_writer: AtomicU64::new(0),
                _reserved1: std::array::from_fn(|_| AtomicU64::new(0)),
            }),
            snapshot: (0..SNAPSHOT_WORDS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    #[test]
    fn a_reset_is_pending_until_the_scheduler_answers_it() {
        let heap = heap();
        let control = Control::new(&heap.area, &heap.snapshot);
        assert_eq!(control.pending_reset(), None);
        let seq = control.request_reset(true).unwrap();
        assert_eq!(control.request_reset(false), Err(ControlError::Busy));
        assert_eq!(control.reset_outcome(seq), None);
        let request = control.pending_reset().unwrap();
        assert_eq!(request, ResetRequest { seq, force: true });
        control.complete_reset(request, ResetStatus::RefusedBusy);
        assert_eq!(control.pending_reset(), None);
        assert_eq!(control.reset_outcome(seq), Some(Ok(ResetStatus::RefusedBusy)));
        // Later resets do not hide this one's status until the history wraps.
        for _ in 0..RESET_HISTORY {
            let later = control.request_reset(false).unwrap();
            assert_eq!(control.reset_outcome(seq), Some(Ok(ResetStatus::RefusedBusy)));
            control.complete_reset(control.pending_reset().unwrap(), ResetStatus::Done);
            assert_eq!(control.reset_outcome(later), Some(Ok(ResetStatus::Done)));
        }
        assert_eq!(control.reset_outcome(seq), Some(Err(ControlError::Overtaken)));
    }

    #[test]
    fn snapshot_requests_of_the_same_depth_share_one_answer() {
        let heap = heap();
        let control = Control::new(&heap.area, &heap.snapshot);
        let first = control.request_snapshot(3).unwrap();
        assert_eq!(control.request_snapshot(3), Ok(first));
        assert_eq!(control.request_snapshot(5), Err(ControlError::Busy));
        assert_eq!(control.read_snapshot(first), Err(ControlError::Busy));
        let request = control.pending_snapshot().unwrap();
        control.publish_snapshot(request, br#"{"nodes":1}"#).unwrap();
        assert_eq!(control.pending_snapshot(), None);
        assert_eq!(control.read_snapshot(first).unwrap(), br#"{"nodes":1}"#);
    }

    #[test]
    fn an_oversized_snapshot_is_reported_with_its_size() {
        let heap = heap();
        let control = Control::new(&heap.area, &heap.snapshot);
        let seq = control.request_snapshot(DEPTH_UNLIMITED).unwrap();
        let request = control.pending_snapshot().unwrap();
        let huge = vec![b' '; SNAPSHOT_BYTES + 1];
        assert_eq!(
            control.publish_snapshot(request, &huge),
            Err(PublishSnapshotError::TooLarge { len: huge.len() })
        );
        assert_eq!(
            control.read_snapshot(seq),
            Err(ControlError::SnapshotTooLarge { len: huge.len() as u64, max: SNAPSHOT_BYTES })
        );
    }

    #[test]
    fn a_snapshot_lock_held_by_another_live_process_is_an_error_not_a_panic() {
        let heap = heap();
        let control = Control::new(&heap.area, &heap.snapshot);
        let seq = control.request_snapshot(1).unwrap();
        let request = control.pending_snapshot().unwrap();
        let mut other = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let holder = crate::liveness::ProcessIdentity::of_pid(other.id()).unwrap();
        let word = (holder.start_time & u64::from(u32::MAX)) << 32 | u64::from(holder.pid);
        heap.area.snapshot_version.store(7, Ordering::Relaxed);
        heap.area.snapshot_writer.store(word, Ordering::Relaxed);
        assert_eq!(
            control.publish_snapshot(request, b"{}"),
            Err(PublishSnapshotError::AreaLocked { pid: other.id() })
        );
        // Once that process is gone, the next publish takes the lock over.
        other.kill().unwrap();
        other.wait().unwrap();
        control.publish_snapshot(request, b"{}").unwrap();
        assert_eq!(control.read_snapshot(seq).unwrap(), b"{}");
    }

    #[test]
    fn an_odd_snapshot_version_left_by_no_writer_is_repaired_by_the_next_publish() {
        let heap = heap();
        let control = Control::new(&heap.area, &heap.snapshot);
        let seq = control.request_snapshot(1).unwrap();
        let request = control.pending_snapshot().unwrap();
        heap.area.snapshot_version.store(7, Ordering::Relaxed);
        control.publish_snapshot(request, b"{}").unwrap();
        assert_eq!(control.read_snapshot(seq).unwrap(), b"{}");
    }

    #[test]
    fn racing_clients_are_all_served_by_a_polling_scheduler() {
        let heap = heap();
        let control = Control::new(&heap.area, &heap.snapshot);
        let stop = crate::sync::AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(request) = control.pending_reset() {
                        control.complete_reset(request, ResetStatus::Done);
                    }
                    if let Some(request) = control.pending_snapshot() {
                        let json = format!("{{\"depth\":{}}}", request.depth);
                        control.publish_snapshot(request, json.as_bytes()).unwrap();
                    }
                    std::thread::yield_now();
                }
            });
            let clients: Vec<_> = (0..4u32)
                .map(|client| {
                    scope.spawn(move || -> Result<(), String> {
                        for _ in 0..20 {
                            let timeout = Duration::from_secs(30);
                            let status = control.reset(client % 2 == 0, timeout);
                            if status != Ok(ResetStatus::Done) {
                                return Err(format!("client {client}: reset gave {status:?}"));
                            }
                            let json = control.fetch_snapshot(client, timeout);
                            if json != Ok(format!("{{\"depth\":{client}}}")) {
                                return Err(format!("client {client}: snapshot gave {json:?}"));
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            let results: Vec<_> = clients.into_iter().map(|client| client.join()).collect();
            // Stop the scheduler before asserting, so that a failure cannot hang the scope.
            stop.store(true, Ordering::Relaxed);
            for result in results {
                assert_eq!(result.expect("client thread panicked"), Ok(()));
            }
        });
    }
}
