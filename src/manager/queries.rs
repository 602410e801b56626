//! Side-effect-free questions an engine asks between operations: where a copy stands, and how
//! many leading blocks every live request shares (cascade attention).

use super::{CacheManager, RequestId, TransferId, UnknownRequest};

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

impl CacheManager {
    /// How many leading blocks of `request`'s block table every live request shares: cached
    /// blocks it has on device that every live request holds, the prefix that cascade attention
    /// computes once (vLLM's `get_num_common_prefix_blocks`). O(blocks of the prefix).
    pub fn common_prefix_blocks(&self, request: RequestId) -> Result<usize, UnknownRequest> {
        let record = self.requests.get(&request).ok_or(UnknownRequest(request))?;
        let live = self.requests.len() as u64;
        let on_device = record.path.len().min(record.table.len());
        Ok(record.path[..on_device]
            .iter()
            .take_while(|&&id| u64::from(self.tree.node(id).ref_count()) == live)
            .count())
    }
}
