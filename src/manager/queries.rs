//! Side-effect-free questions an engine asks between operations: where a copy stands.

use super::{CacheManager, TransferId};

/// Where a copy stands in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferStage {
    /// Created, not yet handed out by `take_transfers` (held back behind other copies, or not
    /// taken yet): no worker has seen it, no byte has moved.
    Queued,
    /// Handed out; the workers may be copying it.
    Issued,
    /// Not in flight: it completed (or was rolled back, or never existed).
    Done,
}

impl CacheManager {
    /// Where copy `id` stands.
    pub fn transfer_stage(&self, id: TransferId) -> TransferStage {
        match self.in_flight.get(&id) {
            Some(flight) if flight.issued => TransferStage::Issued,
            Some(_) => TransferStage::Queued,
            None => TransferStage::Done,
        }
    }
}
