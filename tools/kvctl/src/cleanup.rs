//! `kvctl cleanup`: removing stale segments, garbage under our prefix and orphaned data objects.
//!
//! What may go is decided by [`crate::listing`] (its module documentation states the rule), so
//! `cleanup` removes exactly what `ls` marks removable, and never a live segment.
//!
//! Flow: 1. list and judge; 2. for each removable segment, read its creator word again and skip it
//! if it changed (someone created the name anew meanwhile), then unlink the control object and
//! its data objects; for orphaned data objects, skip them if a control object appeared meanwhile;
//! 3. report what was removed, what was kept and why, and what could not be removed.
//!
//! Another user's objects are never removed, whoever runs cleanup (root included): the listing
//! marks them kept, and the removal checks the owner once more.
//!
//! Limitation: between the last check and the unlink there is still a window in which another
//! process could take over a stale name; creating a name while cleaning it up is not supported.

use std::io::{self, Write};

use kvshm_ipc::inspect;
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::shm::{self, ShmError};
use serde::Serialize;

use crate::listing::{self, SegmentRow, SegmentState};
use crate::probe;
use crate::text::Table;

/// An object cleanup removed (or, with `--dry-run`, would remove).
#[derive(Debug, Clone, Serialize)]
pub struct RemovedObject {
    pub segment: String,
    /// Object name with its leading slash.
    pub object: String,
    pub why: String,
}

/// A segment that is not live and was left alone.
#[derive(Debug, Clone, Serialize)]
pub struct KeptSegment {
    pub segment: String,
    pub state: SegmentState,
    pub why: String,
}

/// An object cleanup meant to remove but could not.
#[derive(Debug, Clone, Serialize)]
pub struct FailedObject {
    pub segment: String,
    pub object: String,
    pub error: String,
}

/// The result of `kvctl cleanup`.
#[derive(Debug, Clone, Serialize)]
pub struct CleanupReport {
    pub dry_run: bool,
    pub removed: Vec<RemovedObject>,
    pub kept: Vec<KeptSegment>,
    pub failed: Vec<FailedObject>,
}

/// Removes what may be removed among the segments named in `only` (all when empty).
pub fn cleanup(only: &[SegmentName], dry_run: bool) -> CleanupReport {
    let mut report =
        CleanupReport { dry_run, removed: Vec::new(), kept: Vec::new(), failed: Vec::new() };
    for row in listing::list(only).segments {
        match row.state {
            SegmentState::Live => {}
            SegmentState::Orphaned => clean_orphans(&row, &mut report),
            SegmentState::Stale | SegmentState::Unreadable if row.removable => {
                clean_segment(&row, &mut report)
            }
            SegmentState::Stale | SegmentState::Unreadable => report.kept.push(KeptSegment {
                segment: row.name.clone(),
                state: row.state,
                why: row.reason.clone().unwrap_or_default(),
            }),
        }
    }
    report
}

fn clean_segment(row: &SegmentRow, report: &mut CleanupReport) {
    let control = row.segment.control_object();
    // The creator word is the segment's identity: if it changed, the name was created anew.
    let creator_now = probe::probe(&control).ok().and_then(|probe| probe.creator);
    if creator_now != row.creator {
        report.kept.push(KeptSegment {
            segment: row.name.clone(),
            state: row.state,
            why: "it changed while cleanup looked at it".to_owned(),
        });
        return;
    }
    let why = row.reason.clone().unwrap_or_else(|| row.state.name().to_owned());
    remove(report, &row.name, &control, &why);
    for data in &row.data_objects {
        if data.removable {
            let why = format!("data object of {} segment", row.state.name());
            remove(report, &row.name, &data.object, &why);
        } else {
            report.kept.push(KeptSegment {
                segment: row.name.clone(),
                state: row.state,
                why: format!("{}: {}", data.object, data.reason.clone().unwrap_or_default()),
            });
        }
    }
}

fn clean_orphans(row: &SegmentRow, report: &mut CleanupReport) {
    let control = row.segment.control_object();
    if inspect::status(&control).is_ok() {
        report.kept.push(KeptSegment {
            segment: row.name.clone(),
            state: row.state,
            why: "a control object appeared while cleanup looked at it".to_owned(),
        });
        return;
    }
    for data in &row.data_objects {
        let why = data.reason.clone().unwrap_or_default();
        if data.removable {
            remove(report, &row.name, &data.object, &format!("orphaned: {why}"));
        } else {
            report.kept.push(KeptSegment {
                segment: row.name.clone(),
                state: row.state,
                why: format!("{}: {why}", data.object),
            });
        }
    }
}

fn remove(report: &mut CleanupReport, segment: &str, object: &str, why: &str) {
    // shm::unlink checks the owner once more: another user's object is never removed.
    let outcome = if report.dry_run { Ok(()) } else { shm::unlink(object) };
    match outcome {
        Ok(()) => report.removed.push(RemovedObject {
            segment: segment.to_owned(),
            object: object.to_owned(),
            why: why.to_owned(),
        }),
        // Someone else removed it first: nothing left to do.
        Err(ShmError::NotFound { .. }) => {}
        Err(error) => report.failed.push(FailedObject {
            segment: segment.to_owned(),
            object: object.to_owned(),
            error: error.to_string(),
        }),
    }
}

impl CleanupReport {
    pub fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        let verb = if self.dry_run { "would remove" } else { "removed" };
        if self.removed.is_empty() {
            writeln!(out, "nothing to remove")?;
        } else {
            let mut table = Table::new(&[&verb.to_uppercase(), "WHY"]);
            for removed in &self.removed {
                table.push(vec![removed.object.clone(), removed.why.clone()]);
            }
            table.write(out)?;
        }
        for kept in &self.kept {
            writeln!(out, "kept {} ({}): {}", kept.segment, kept.state.name(), kept.why)?;
        }
        for failed in &self.failed {
            writeln!(out, "could not remove {}: {}", failed.object, failed.error)?;
        }
        Ok(())
    }
}
