//! `kvctl workers`: one row per tensor-parallel rank, with the scheduler's liveness judgement.
//!
//! Each rank's worker slot is copied out ([`WorkerSlot::view`]) and judged the way the scheduler
//! judges it ([`WorkerSlot::status`] with [`HeartbeatLimits::DEFAULT`]: a serving worker's limit,
//! or the longer one of a worker still setting up): alive, dead (with the reason: the process is
//! gone, a zombie, its pid reused, or its heartbeat too old), or empty.
//!
//! Flow: 1. attach; 2. read `now` once; 3. per rank, view and judge the slot; 4. print.

use std::io::{self, Write};
use std::time::Duration;

use kvshm_ipc::liveness::{monotonic_ns, ProcessStatus};
use kvshm_ipc::segment::Segment;
use kvshm_ipc::worker_slot::{HeartbeatLimits, RankStatus, WorkerSlot, WorkerState};
use serde::Serialize;

use crate::text::{self, Table};

/// The judgement of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Alive,
    Dead,
    Empty,
}

/// One rank's worker.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerRow {
    pub rank: u32,
    /// The slot state word: `empty`, `attached`, `dead` or `unknown`.
    pub state: &'static str,
    pub pid: Option<u32>,
    /// Seconds since the last heartbeat, if the worker ever beat.
    pub heartbeat_age_seconds: Option<f64>,
    /// Seconds since the worker attached.
    pub attached_for_seconds: Option<f64>,
    /// How many times any worker claimed this rank.
    pub attach_count: u64,
    /// The worker finished setting up and serves its rings (a live worker that does not yet gets
    /// no copies from the scheduler).
    pub serving: bool,
    pub verdict: Verdict,
    /// Why a worker is judged dead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The result of `kvctl workers`.
#[derive(Debug, Clone, Serialize)]
pub struct WorkersReport {
    pub segment: String,
    pub tp_size: u32,
    /// The heartbeat limit of a serving worker.
    pub heartbeat_timeout_seconds: f64,
    /// The heartbeat limit of a worker still setting up.
    pub setup_heartbeat_timeout_seconds: f64,
    pub ranks: Vec<WorkerRow>,
}

/// Judges `slot` of `rank` at `now_ns`.
pub fn judge_slot(rank: u32, slot: &WorkerSlot, now_ns: u64) -> WorkerRow {
    let view = slot.view();
    let since = |ns: u64| (ns != 0).then(|| Duration::from_nanos(now_ns.saturating_sub(ns)));
    let heartbeat_age = since(view.heartbeat_ns);
    let limits = HeartbeatLimits::DEFAULT;
    let limit = if view.serving { limits.serving } else { limits.setting_up };
    let (verdict, reason) = match slot.status(now_ns, limits) {
        RankStatus::Empty => (Verdict::Empty, None),
        RankStatus::Alive { .. } => (Verdict::Alive, None),
        RankStatus::Dead { .. } => (
            Verdict::Dead,
            Some(death_reason(view.state, view.worker.status(), heartbeat_age, limit)),
        ),
    };
    let attached = view.state != WorkerState::Empty;
    WorkerRow {
        rank,
        state: view.state.name(),
        pid: attached.then_some(view.worker.pid),
        heartbeat_age_seconds: heartbeat_age.map(|age| age.as_secs_f64()),
        attached_for_seconds: since(view.attached_at_ns).map(|age| age.as_secs_f64()),
        attach_count: view.attach_count,
        serving: view.serving,
        verdict,
        reason,
    }
}

fn death_reason(
    state: WorkerState,
    process: ProcessStatus,
    heartbeat_age: Option<Duration>,
    limit: Duration,
) -> String {
    match (state, process) {
        (WorkerState::Dead, _) => {
            "the slot is marked dead, awaiting the scheduler's reclaim".to_owned()
        }
        (WorkerState::Unknown(code), _) => format!("the slot holds unknown state {code}"),
        (_, ProcessStatus::Exited) => "the process is gone".to_owned(),
        (_, ProcessStatus::Zombie) => "the process is a zombie".to_owned(),
        (_, ProcessStatus::Reused) => "the pid now belongs to another process".to_owned(),
        (_, ProcessStatus::Alive) => format!(
            "no heartbeat for {} (limit {})",
            heartbeat_age.map_or_else(|| "ever".to_owned(), text::age),
            text::age(limit)
        ),
    }
}

impl WorkersReport {
    /// Reads and judges every rank of `segment`.
    pub fn read(segment: &Segment) -> WorkersReport {
        let now = monotonic_ns();
        let tp_size = segment.config().tp_size;
        let ranks = (0..tp_size)
            .filter_map(|rank| {
                segment.worker_slot(rank).ok().map(|slot| judge_slot(rank, slot, now))
            })
            .collect();
        WorkersReport {
            segment: segment.name().to_string(),
            tp_size,
            heartbeat_timeout_seconds: HeartbeatLimits::DEFAULT.serving.as_secs_f64(),
            setup_heartbeat_timeout_seconds: HeartbeatLimits::DEFAULT.setting_up.as_secs_f64(),
            ranks,
        }
    }

    pub fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        let mut table =
            Table::new(&["RANK", "STATE", "PID", "HEARTBEAT", "ATTACHED", "ATTACHES", "VERDICT"]);
        for row in &self.ranks {
            let ago = |seconds: Option<f64>| {
                seconds.map_or_else(
                    || "-".to_owned(),
                    |seconds| format!("{} ago", text::age(Duration::from_secs_f64(seconds))),
                )
            };
            let verdict = match (&row.verdict, &row.reason) {
                (Verdict::Dead, Some(reason)) => format!("dead: {reason}"),
                (Verdict::Alive, _) if row.serving => "alive".to_owned(),
                (Verdict::Alive, _) => "alive, setting up".to_owned(),
                (Verdict::Dead, None) => "dead".to_owned(),
                (Verdict::Empty, _) => "no worker".to_owned(),
            };
            table.push(vec![
                row.rank.to_string(),
                row.state.to_owned(),
                text::or_dash(row.pid),
                ago(row.heartbeat_age_seconds),
                ago(row.attached_for_seconds),
                row.attach_count.to_string(),
                verdict,
            ]);
        }
        table.write(out)
    }
}
