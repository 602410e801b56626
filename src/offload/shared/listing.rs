//! [`inspect_tier`]: what a shared tier's control object says of its owner and its clients, for
//! `kvctl tier` and the Python binding, read without joining the tier (no slot is claimed).
//!
//! 1. attach to the control object (checked as a client checks it; a tier whose owner died is
//!    refused here: its clients are released by the next owner);
//! 2. decode the identity (`None` when this build cannot read it);
//! 3. per slot, copy out the owner word (state and pid) and the figures the owner published
//!    (`ClientStats`): chunks charged, pins, pending stores, calls served;
//! 4. the figures of the storage tier below, if the owner has one (`StorageStats`).

use kvshm_ipc::name::SegmentName;
use kvshm_ipc::tier_control::{TierAttachError, TierControl};
use kvshm_ipc::worker_slot::WorkerState;
use serde::Serialize;

use super::{TierIdentity, TierStorageStats};

/// One client slot of a tier.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ClientRow {
    pub slot: u32,
    /// `attached`, `dead` (being reclaimed) or `unknown` (a word this build does not know).
    pub state: &'static str,
    pub pid: u32,
    /// Chunks charged to the client: the blocks it stored that are still in the tier.
    pub chunks: u32,
    /// Loads in progress.
    pub pins: u32,
    /// Stores prepared and not completed.
    pub storing: u32,
    /// Calls the owner served it.
    pub calls: u64,
}

/// A tier, as [`inspect_tier`] reads it.
#[derive(Clone, Debug, Serialize)]
pub struct TierReport {
    pub tier: String,
    pub owner_pid: u32,
    pub identity: Option<TierIdentity>,
    pub client_slots: u32,
    /// The slots a client holds, in slot order.
    pub clients: Vec<ClientRow>,
    /// The storage tier below the tier, if it has one (DESIGN §12.8).
    pub storage: Option<TierStorageStats>,
}

/// Module flow.
///
/// # Errors
/// [`TierAttachError`] when no live owner serves `name`, or its object is not a tier's.
pub fn inspect_tier(name: &SegmentName) -> Result<TierReport, TierAttachError> {
    let control = TierControl::attach(name)?;
    let identity = TierIdentity::decode(&control.identity());
    let slots = control.config().clients;
    let mut clients = Vec::new();
    for slot in 0..slots {
        let (Some(client), Some(stats)) = (control.client_slot(slot), control.client_stats(slot))
        else {
            continue;
        };
        let word = client.owner();
        let state = match word.state() {
            WorkerState::Empty => continue,
            WorkerState::Attached => "attached",
            WorkerState::Dead => "dead",
            WorkerState::Unknown(_) => "unknown",
        };
        let figures = stats.read();
        clients.push(ClientRow {
            slot,
            state,
            pid: word.pid(),
            chunks: figures.chunks,
            pins: figures.pins,
            storing: figures.storing,
            calls: figures.calls,
        });
    }
    Ok(TierReport {
        tier: name.as_str().to_owned(),
        owner_pid: control.owner().pid,
        identity,
        client_slots: slots,
        clients,
        storage: control.storage_stats().read().as_ref().map(TierStorageStats::from_words),
    })
}
