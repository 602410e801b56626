//! [`TierOwner`]: the tier's owner process's side of its clients (DESIGN §12.4): the index, and
//! a handle on each client's process, so that a client that dies (SIGKILL included) has its pins
//! and pending stores released at the owner's next sweep.
//!
//! 1. [`TierOwner::attach_process`] opens a handle on the client's process (a pidfd, checked
//!    against the process's start time, so a reused pid never stands for it) and attaches it to
//!    the index;
//! 2. the owner serves the client's calls through [`TierOwner::index`];
//! 3. [`TierOwner::reap`], called at every turn of the owner's loop (its doorbell waits at most
//!    [`SWEEP_INTERVAL`]), releases every client whose process has exited: its loads, its pending
//!    stores and its requests go, its stored blocks stay, and the chunks it may still be writing
//!    go to no store for [`DEAD_CLIENT_GRACE`] (`release.rs`);
//! 4. [`TierOwner::detach`] ends a client that leaves on its own.
//!
//! [`TierServer`](super::TierServer) runs it in the owner process, over the clients' rings.

use std::time::{Duration, Instant};

use kvshm_ipc::liveness::ProcessIdentity;
use kvshm_ipc::process_handle::{OpenError, ProcessHandle};
use serde::Serialize;

use super::{
    ClientId, ClientSummary, Released, SharedTierError, SharedTierIndex, TierIdentity,
    DEAD_CLIENT_GRACE,
};

/// The longest the owner's loop waits between two sweeps of its clients' processes: a client's
/// death is acted on within it (plus one sweep), well within the 100 ms DESIGN §12.4 promises.
pub const SWEEP_INTERVAL: Duration = Duration::from_millis(10);

/// Why a client could not attach. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttachError {
    #[error("the client's process could not be watched: {0}")]
    Process(#[from] OpenError),
    #[error(transparent)]
    Tier(#[from] SharedTierError),
}

/// A client released because its process exited.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Reaped {
    pub client: ClientId,
    pub pid: u32,
    pub released: Released,
}

/// A client as `kvctl` lists it: the index's summary and its process.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ClientProcess {
    pub pid: u32,
    #[serde(flatten)]
    pub summary: ClientSummary,
}

/// The index and its clients' processes (module flow).
#[derive(Debug)]
pub struct TierOwner {
    index: SharedTierIndex,
    processes: Vec<(ClientId, ProcessHandle)>,
}

impl TierOwner {
    pub fn new(index: SharedTierIndex) -> TierOwner {
        TierOwner { index, processes: Vec::new() }
    }

    /// Module flow, step 1: attaches the client running as `process`.
    ///
    /// # Errors
    /// [`AttachError::Process`] when the process is gone (or its pid names another process
    /// now); [`AttachError::Tier`] when the index refuses it (another identity, no free slot).
    pub fn attach_process(
        &mut self,
        identity: &TierIdentity,
        name: &str,
        quota: Option<u32>,
        process: ProcessIdentity,
    ) -> Result<ClientId, AttachError> {
        let handle = ProcessHandle::open(process)?;
        let client = self.index.attach(identity, name, quota)?;
        self.processes.push((client, handle));
        Ok(client)
    }

    /// Module flow, step 2: the index, to serve the clients' calls.
    pub fn index(&mut self) -> &mut SharedTierIndex {
        &mut self.index
    }

    /// Module flow, step 3: releases every client whose process has exited, appending what
    /// each gave back to `reaped`; the chunks its copy side may still be writing go to no store
    /// for [`DEAD_CLIENT_GRACE`], and those of clients dead for longer are free again.
    pub fn reap(&mut self, reaped: &mut Vec<Reaped>) {
        let now = Instant::now();
        let index = &mut self.index;
        index.return_held_back(now);
        self.processes.retain(|(client, handle)| {
            if handle.is_alive() {
                return true;
            }
            let released = index
                .release_dead_client(*client, now + DEAD_CLIENT_GRACE)
                .expect("a watched client is attached: a programming error otherwise");
            reaped.push(Reaped { client: *client, pid: handle.identity().pid, released });
            false
        });
    }

    /// Module flow, step 4: ends a client that leaves on its own.
    pub fn detach(&mut self, client: ClientId) -> Result<Released, SharedTierError> {
        let released = self.index.release_client(client)?;
        self.processes.retain(|(watched, _)| *watched != client);
        Ok(released)
    }

    /// Ends a client whose process was found dead outside a sweep (its channel broke as it
    /// died): as [`TierOwner::reap`] would, the chunks its copy side may still be writing go to
    /// no store for [`DEAD_CLIENT_GRACE`].
    pub fn release_dead(&mut self, client: ClientId) -> Result<Released, SharedTierError> {
        let released =
            self.index.release_dead_client(client, Instant::now() + DEAD_CLIENT_GRACE)?;
        self.processes.retain(|(watched, _)| *watched != client);
        Ok(released)
    }

    /// The attached clients with their processes, for `kvctl`.
    pub fn clients(&self) -> Vec<ClientProcess> {
        let summaries = self.index.clients();
        summaries
            .into_iter()
            .filter_map(|summary| {
                let (_, handle) = self.processes.iter().find(|(id, _)| *id == summary.id)?;
                Some(ClientProcess { pid: handle.identity().pid, summary })
            })
            .collect()
    }
}
