//! [`TierServer`]: the owner process of a shared tier (DESIGN §12.3-12.4): its control object,
//! the index its clients share ([`TierOwner`]), and one channel per client, served in turns.
//!
//! One turn ([`TierServer::turn`]):
//! 1. wait on the owner's doorbell (spinning [`OWNER_SPIN`] first) until a client rang or
//!    [`SWEEP_INTERVAL`] passed;
//! 2. adopt the clients that claimed a slot since the last turn: a pidfd on the process the slot
//!    names, an attach to the index, the owner's end of the slot's channel;
//! 3. release the clients whose process exited ([`TierOwner::reap`]) or that detached, and
//!    reclaim their slots (the channel reset before another client can claim it);
//! 4. serve every client's batch: each call is checked, carried out on the index and, where it
//!    has one, answered (`calls.rs`); the batch's end is answered last;
//! 5. evict ahead of demand, the answers sent, in slices until a client asks
//!    ([`SharedTierIndex::evict_ahead`]).
//!
//! A client whose ring or answers make no sense is let go: a bad record is an error answer for
//! its call, a broken ring the client's end, never a panic of the owner. Its slot is fenced, not
//! emptied, while its process lives (as a worker's rank is): that process may still write the
//! slot's rings and key page, which no other client may share, and copy into the chunks it
//! holds, which no other store may have: the slot is reclaimed, and the client released as a
//! dead one is, at the first sweep after the process exits.

mod calls;

use std::time::{Duration, Instant};

use kvshm_ipc::doorbell::{WaitPolicy, DEFAULT_SPIN};
use kvshm_ipc::liveness::ProcessIdentity;
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::tier_control::{
    AnswerStatus, ClientFigures, OwnerChannel, TierAnswer, TierConfig, TierControl,
    TierCreateError, TierOp, TierRequest, WireKey,
};
use kvshm_ipc::worker_slot::{OwnerWord, WorkerState};
use serde::Serialize;

use super::{
    ClientId, Reaped, Released, SharedTierError, SharedTierIndex, TierOwner, TierStorage,
    EVICT_AHEAD_SLICE, SWEEP_INTERVAL,
};
use crate::offload::key::OffloadKey;
use crate::offload::manager::PreparedStore;

/// The longest the owner's loop waits while storage jobs are in flight: a block brought back
/// from storage is loadable within it of its read.
const STORAGE_POLL_INTERVAL: Duration = Duration::from_millis(1);

/// How long the owner spins for the next batch before it sleeps, by default: an engine's calls
/// come in bursts (a step's lookups, stores and their ends), and a wake from sleep costs tens of
/// microseconds (`kvshm_ipc::doorbell`, "How long to spin"), which would fall on the engine's
/// next wait. `kvshm tier-owner --spin-us`. Only while a client called within the last
/// [`SPIN_WHILE_CALLED_WITHIN`]: an idle owner spins as any waiter ([`DEFAULT_SPIN`]).
pub const OWNER_SPIN: Duration = Duration::from_millis(1);

/// How recent a batch keeps the owner's long spin.
const SPIN_WHILE_CALLED_WITHIN: Duration = Duration::from_millis(100);

/// Why the owner could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Create(#[from] TierCreateError),
    #[error(transparent)]
    Tier(#[from] SharedTierError),
}

/// What the owner has done, for its log and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ServeStats {
    pub clients_adopted: u64,
    pub clients_released: u64,
    pub batches: u64,
    pub calls: u64,
    /// Calls refused: a bad record, or the index refused it.
    pub calls_failed: u64,
}

/// A client the owner let go, and what it gave back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ClientGone {
    pub slot: u32,
    pub pid: u32,
    /// Its process exited (else it detached, or broke its channel).
    pub died: bool,
    #[serde(flatten)]
    pub released: Released,
}

/// A client the owner serves.
struct Served {
    client: ClientId,
    word: OwnerWord,
    process: ProcessIdentity,
    channel: OwnerChannel,
    /// The next free entry of its answer page in the batch being served.
    next_entry: u32,
    detached: bool,
    /// Calls served, for its published figures.
    calls: u64,
}

/// The owner of one shared tier (module flow).
pub struct TierServer {
    /// The storage tier below this one, if it has one (`storage/`). First, so that it is dropped
    /// first: its I/O thread, which may be writing the arenas, ends before the control object
    /// goes and another owner may take the arenas over.
    storage: Option<TierStorage>,
    control: TierControl,
    owner: TierOwner,
    served: Vec<Option<Served>>,
    /// Slots of clients released while their process lives, with the client, the word and the
    /// process: reclaimed, and the client's holdings released, once it has exited (module
    /// documentation).
    fenced: Vec<(u32, ClientId, OwnerWord, ProcessIdentity)>,
    stats: ServeStats,
    last_reap: Instant,
    /// Until then every store is refused (a previous owner's clients may still write chunks).
    stores_refused_until: Option<Instant>,
    /// The quota of chunks every client it adopts gets, if any (`SharedTierIndex::attach`).
    client_quota: Option<u32>,
    /// How long a turn spins for a batch before it sleeps ([`OWNER_SPIN`]), and when it last
    /// served one.
    spin: Duration,
    last_batch: Instant,
    // Scratch, reused between turns.
    requests: Vec<TierRequest>,
    answers: Vec<TierAnswer>,
    wire_keys: Vec<WireKey>,
    keys: Vec<OffloadKey>,
    chunks: Vec<u32>,
    entries: Vec<u32>,
    prepared: PreparedStore,
    reaped: Vec<Reaped>,
    gone: Vec<ClientGone>,
    request_name: String,
}

impl std::fmt::Debug for TierServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierServer")
            .field("control", &self.control)
            .field("stats", &self.stats)
            .finish()
    }
}

impl TierServer {
    /// Creates tier `name`'s control object for `index`'s identity, with `tier`'s slots and
    /// pages.
    pub fn create(
        name: &SegmentName,
        index: SharedTierIndex,
        tier: &TierConfig,
    ) -> Result<TierServer, ServeError> {
        let server = TierServer::create_closed(name, index, tier)?;
        server.open_to_clients();
        Ok(server)
    }

    /// [`TierServer::create`], but no client attaches until [`TierServer::open_to_clients`]
    /// ([`TierControl::create_closed`]): the owner sets up its key table and storage tier with
    /// the name its own, and opens once it serves.
    pub fn create_closed(
        name: &SegmentName,
        index: SharedTierIndex,
        tier: &TierConfig,
    ) -> Result<TierServer, ServeError> {
        let control = TierControl::create_closed(name, tier, &index.identity().encode())?;
        Ok(TierServer {
            served: (0..tier.clients).map(|_| None).collect(),
            fenced: Vec::new(),
            control,
            owner: TierOwner::new(index),
            stats: ServeStats::default(),
            last_reap: Instant::now(),
            stores_refused_until: None,
            client_quota: None,
            spin: OWNER_SPIN,
            last_batch: Instant::now(),
            storage: None,
            requests: Vec::new(),
            answers: Vec::new(),
            wire_keys: Vec::new(),
            keys: Vec::new(),
            chunks: Vec::new(),
            entries: Vec::new(),
            prepared: PreparedStore::default(),
            reaped: Vec::new(),
            gone: Vec::new(),
            request_name: String::new(),
        })
    }

    /// Lets clients attach to a server made by [`TierServer::create_closed`].
    pub fn open_to_clients(&self) {
        self.control.open_to_clients();
    }

    pub fn stats(&self) -> ServeStats {
        self.stats
    }

    /// Refuses every store until `until`: the tier took over arenas whose previous owner's
    /// clients may still be copying into chunks they were handed (`arenas.rs`), and no chunk is
    /// handed to another store meanwhile.
    pub fn refuse_stores_until(&mut self, until: Instant) {
        self.stores_refused_until = Some(until);
    }

    /// Gives every client adopted from now on a quota of `chunks` chunks: a store that would
    /// take it past them evicts its own least recently used keys, never another client's.
    pub fn set_client_quota(&mut self, chunks: Option<u32>) {
        self.client_quota = chunks;
    }

    /// Spins this long for a batch before sleeping, from now on ([`OWNER_SPIN`]).
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// Serves `storage` as the storage tier below this one from now on.
    pub fn keep_storage(&mut self, storage: TierStorage) {
        self.storage = Some(storage);
    }

    pub fn storage(&self) -> Option<&TierStorage> {
        self.storage.as_ref()
    }

    /// Finishes the storage tier's work in flight and what waits to be written, for at most
    /// `limit` (an owner that stops).
    pub fn drain_storage(&mut self, limit: std::time::Duration) {
        if let Some(storage) = &mut self.storage {
            storage.drain(self.owner.index(), limit);
        }
    }

    /// Clients served now.
    pub fn clients_attached(&self) -> usize {
        self.served.iter().flatten().count()
    }

    /// The clients let go since the last call.
    pub fn take_gone(&mut self) -> Vec<ClientGone> {
        std::mem::take(&mut self.gone)
    }

    /// The tier's owner: the index and its clients' processes.
    pub fn owner(&mut self) -> &mut TierOwner {
        &mut self.owner
    }

    /// One turn of the owner's loop (module flow).
    pub fn turn(&mut self) {
        let served = &mut self.served;
        // Storage jobs in flight finish at the next turn: a shorter wait then.
        let most = match &self.storage {
            Some(storage) if storage.busy() => STORAGE_POLL_INTERVAL,
            _ => SWEEP_INTERVAL,
        };
        // The long spin only while clients call: an idle owner would spin at every turn.
        let spin = if self.last_batch.elapsed() < SPIN_WHILE_CALLED_WITHIN {
            self.spin
        } else {
            DEFAULT_SPIN.min(self.spin)
        };
        let _ = self.control.owner_bell().wait_until(
            || served.iter_mut().flatten().any(|served| !served.channel.is_idle()),
            WaitPolicy::new(spin, WaitPolicy::default().sleep_slice).within(most),
        );
        if let Some(storage) = &mut self.storage {
            storage.poll(self.owner.index());
        }
        self.adopt_new_clients();
        if self.last_reap.elapsed() >= SWEEP_INTERVAL {
            self.last_reap = Instant::now();
            self.reap();
        }
        for slot in 0..self.served.len() {
            self.serve(slot);
        }
        // Step 5, in slices: a batch that comes meanwhile waits for one slice at most.
        while self.owner.index().evict_ahead(EVICT_AHEAD_SLICE) == EVICT_AHEAD_SLICE
            && self.served.iter_mut().flatten().all(|served| served.channel.is_idle())
        {}
        if let Some(storage) = &self.storage {
            self.control.storage_stats().publish(&storage.stats().to_words());
        }
    }

    /// Module flow, step 2.
    fn adopt_new_clients(&mut self) {
        for slot in 0..self.served.len() as u32 {
            if self.fenced.iter().any(|&(fenced, ..)| fenced == slot) {
                continue;
            }
            let Some(client_slot) = self.control.client_slot(slot) else { continue };
            let word = client_slot.owner();
            match (&self.served[slot as usize], word.state()) {
                (Some(served), _) if served.word == word => continue,
                (Some(_), _) => {
                    // Only the owner empties a slot: a word it did not see is a scribble. The
                    // client it served is gone from this slot.
                    self.release(slot);
                    continue;
                }
                (None, WorkerState::Attached) => {}
                (None, WorkerState::Unknown(_)) => {
                    self.reclaim(slot, word);
                    continue;
                }
                (None, _) => continue,
            }
            // A claim still writing its fields is adopted at a later turn; one whose claimant
            // died before it wrote them is reclaimed.
            let Some(fields) = client_slot.claim_fields(word) else {
                if !ProcessIdentity::new(word.pid(), 0).is_alive() {
                    self.reclaim(slot, word);
                }
                continue;
            };
            let process = ProcessIdentity::new(word.pid(), fields.start_time);
            let identity = self.owner.index().identity().clone();
            let name = format!("pid {}", word.pid());
            let adopted =
                match self.owner.attach_process(&identity, &name, self.client_quota, process) {
                    // SAFETY: the one owner end of the slot: `served[slot]` is empty here (a slot is
                    // adopted only when it is), and its channel is dropped with it before it is
                    // adopted again.
                    Ok(client) => match unsafe { self.control.owner_channel(slot) } {
                        Ok(channel) => Some(Served {
                            client,
                            word,
                            process,
                            channel,
                            next_entry: 0,
                            detached: false,
                            calls: 0,
                        }),
                        Err(error) => {
                            tracing::warn!(slot, %error, "a client's channel is broken: released");
                            let _ = self.owner.detach(client);
                            None
                        }
                    },
                    Err(error) => {
                        tracing::info!(slot, %error, "a client gone before it was adopted");
                        None
                    }
                };
            match adopted {
                Some(served) => {
                    self.served[slot as usize] = Some(served);
                    self.stats.clients_adopted += 1;
                }
                None => {
                    self.reclaim(slot, word);
                }
            }
        }
    }

    /// Module flow, step 3: the clients whose process exited, and the fenced slots whose
    /// process has.
    fn reap(&mut self) {
        self.reaped.clear();
        self.owner.reap(&mut self.reaped);
        let control = &self.control;
        let mut fenced_gone = Vec::new();
        self.fenced.retain(|&(slot, client, word, process)| {
            if process.is_alive() {
                return true;
            }
            reclaim_logged(control, slot, word);
            fenced_gone.push((client, slot));
            false
        });
        for reaped in std::mem::take(&mut self.reaped) {
            tracing::info!(pid = reaped.pid, ?reaped.released, "a client died: released");
            if let Some(&(_, slot)) =
                fenced_gone.iter().find(|(client, _)| *client == reaped.client)
            {
                let (pid, released) = (reaped.pid, reaped.released);
                self.gone.push(ClientGone { slot, pid, died: true, released });
                continue;
            }
            // The control object's slot that served this client: the index numbers its clients
            // in the order it adopted them, which need not be the order of their slots.
            let Some(slot) = self.served.iter().position(|served| {
                served.as_ref().is_some_and(|served| served.client == reaped.client)
            }) else {
                continue;
            };
            let (pid, released) = (reaped.pid, reaped.released);
            let slot = slot as u32;
            self.gone.push(ClientGone { slot, pid, died: true, released });
            if let Some(served) = self.served[slot as usize].take() {
                self.publish_figures(slot);
                let word = served.word;
                drop(served);
                self.reclaim(slot, word);
                self.stats.clients_released += 1;
            }
        }
    }

    /// Publishes what the client of `slot` holds (module documentation of `ClientStats`);
    /// zeroes for a slot no client is served on.
    fn publish_figures(&mut self, slot: u32) {
        let figures = match &self.served[slot as usize] {
            Some(served) => {
                let summary = self.owner.index().client_summary(served.client);
                summary.map_or_else(ClientFigures::default, |summary| ClientFigures {
                    chunks: summary.chunks,
                    pins: summary.pins,
                    storing: summary.storing,
                    calls: served.calls,
                })
            }
            None => ClientFigures::default(),
        };
        if let Some(stats) = self.control.client_stats(slot) {
            stats.publish(figures);
        }
    }

    /// Empties `slot` from the word `word` (module documentation), saying why if it cannot.
    fn reclaim(&self, slot: u32, word: OwnerWord) {
        reclaim_logged(&self.control, slot, word);
    }

    /// Releases the client of `slot`: it detached (its end of the channel is gone: the slot is
    /// reclaimed now, its holdings released), or broke its channel. Its process may then still
    /// write the channel, and copy into the chunks it holds (its pending stores, its lease) or
    /// out of its pins' chunks: the slot is fenced and the index keeps its holdings until the
    /// process exits ([`TierOwner::reap`]).
    fn release(&mut self, slot: u32) {
        let Some(served) = self.served[slot as usize].take() else { return };
        self.publish_figures(slot);
        let (word, process, detached) = (served.word, served.process, served.detached);
        let pid = word.pid();
        if detached || !process.is_alive() {
            let released = if detached {
                self.owner.detach(served.client)
            } else {
                self.owner.release_dead(served.client)
            };
            if let Ok(released) = released {
                self.gone.push(ClientGone { slot, pid, died: !detached, released });
            }
            self.reclaim(slot, word);
        } else {
            let released = Released::default();
            self.gone.push(ClientGone { slot, pid, died: false, released });
            self.fenced.push((slot, served.client, word, process));
        }
        self.stats.clients_released += 1;
    }

    /// Module flow, step 4, for one slot.
    fn serve(&mut self, slot: usize) {
        let Some(served) = self.served[slot].as_mut() else { return };
        self.requests.clear();
        if let Err(error) = served.channel.take_requests(&mut self.requests) {
            tracing::warn!(slot, %error, "a client's ring is broken: released");
            self.release(slot as u32);
            return;
        }
        if self.requests.is_empty() {
            return;
        }
        self.answers.clear();
        let requests = std::mem::take(&mut self.requests);
        for request in &requests {
            self.stats.calls += 1;
            let answer = self.carry_out(slot, request);
            if let Some(answer) = answer {
                if answer.status() == AnswerStatus::Failed {
                    self.stats.calls_failed += 1;
                }
                self.answers.push(answer);
            }
        }
        let served = self.served[slot].as_mut().expect("served above");
        served.calls += requests.iter().filter(|r| r.op() != Ok(TierOp::EndBatch)).count() as u64;
        self.requests = requests;
        // The figures first: a client that has its answers sees them (`kvctl tier`) as of its
        // batch.
        self.publish_figures(slot as u32);
        let served = self.served[slot].as_mut().expect("served above");
        let answered = served.channel.answer(&self.answers);
        let detached = served.detached;
        if answered.is_err() || detached {
            if answered.is_err() {
                tracing::warn!(slot, "a client left no room for its answers: released");
            }
            self.release(slot as u32);
        }
    }
}

/// [`TierControl::reclaim_client`], its failure logged: the slot stays unclaimable (a word
/// changed under the owner, which only a scribble does) and an operator should know.
fn reclaim_logged(control: &TierControl, slot: u32, word: OwnerWord) {
    if let Err(error) = control.reclaim_client(slot, word) {
        tracing::warn!(slot, %error, "a client slot could not be reclaimed; it stays unclaimable");
    }
}
