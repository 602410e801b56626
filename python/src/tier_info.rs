//! The functions that name a shared tier, find its owner and list its clients, for the
//! Python side that starts owners (`kvshm.shared_tier`) and for `kvctl tier`.

use kvshm::offload::{inspect_tier, TierIdentity};
use kvshm_ipc::tier_control::TierControl;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::SegmentError;
use crate::service::segment_name;

/// The name of the shared tier of blocks of this identity (`kvshm-tier-MODEL-DIGEST`).
#[pyfunction]
#[pyo3(signature = (*, model, kv_dtype, block_tokens, block_bytes, blocks_per_chunk, layout))]
pub fn shared_tier_name(
    model: String,
    kv_dtype: String,
    block_tokens: u32,
    block_bytes: u64,
    blocks_per_chunk: u32,
    layout: String,
) -> String {
    TierIdentity { model, kv_dtype, block_tokens, block_bytes, blocks_per_chunk, layout }
        .tier_name()
}

/// The pid of the live owner of shared tier `name`, or `None` when no owner serves it. With
/// `setting_up`, also that of a live owner still setting up, closed to engines.
#[pyfunction]
#[pyo3(signature = (name, *, setting_up=false))]
pub fn shared_tier_owner(name: &str, setting_up: bool) -> PyResult<Option<u32>> {
    let name = segment_name(name)?;
    let serving = TierControl::attach(&name).ok().map(|control| control.owner().pid);
    Ok(serving.or_else(|| setting_up.then(|| TierControl::setting_up(&name)).flatten()))
}

/// Shared tier `name`'s clients as its owner published them (`kvctl tier`): one dict per
/// client, with `slot`, `state`, `pid`, `chunks`, `pins`, `storing` and `calls`.
#[pyfunction]
pub fn shared_tier_clients<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyList>> {
    let report = inspect_tier(&segment_name(name)?)
        .map_err(|error| SegmentError::new_err(format!("shared tier {name}: {error}")))?;
    let clients = PyList::empty(py);
    for row in report.clients {
        let client = PyDict::new(py);
        client.set_item("slot", row.slot)?;
        client.set_item("state", row.state)?;
        client.set_item("pid", row.pid)?;
        client.set_item("chunks", row.chunks)?;
        client.set_item("pins", row.pins)?;
        client.set_item("storing", row.storing)?;
        client.set_item("calls", row.calls)?;
        clients.append(client)?;
    }
    Ok(clients)
}
