//! `kvctl tier`: a shared host tier's owner and its clients, one row per client with the chunks
//! charged to it, its pins and its pending stores, and the storage tier below it if it has one
//! (what it holds, writes and brings back), as the owner last published them
//! ([`kvshm::offload::inspect_tier`]). A client that died is released by the owner within its
//! sweep (10 ms) and leaves the listing then; a tier whose owner died is refused with the way
//! out: the next engine starts an owner, or `kvctl cleanup` removes what is left.

use std::io::{self, Write};

use kvshm::offload::TierReport;

use crate::text::Table;

/// Writes `report` as text: the tier's owner and identity, then the clients' table.
pub fn write_text(report: &TierReport, out: &mut dyn Write) -> io::Result<()> {
    writeln!(out, "tier {}: owner pid {}", report.tier, report.owner_pid)?;
    match &report.identity {
        Some(identity) => writeln!(
            out,
            "blocks: model {}, {}, {} tokens, {} bytes, {} a chunk, layout {:?}",
            identity.model,
            identity.kv_dtype,
            identity.block_tokens,
            identity.block_bytes,
            identity.blocks_per_chunk,
            identity.layout
        )?,
        None => writeln!(out, "blocks: an identity this build cannot read")?,
    }
    writeln!(out, "clients: {} of {} slots", report.clients.len(), report.client_slots)?;
    let mut table = Table::new(&["SLOT", "STATE", "PID", "CHUNKS", "PINS", "STORING", "CALLS"]);
    for row in &report.clients {
        table.push(vec![
            row.slot.to_string(),
            row.state.to_owned(),
            row.pid.to_string(),
            row.chunks.to_string(),
            row.pins.to_string(),
            row.storing.to_string(),
            row.calls.to_string(),
        ]);
    }
    table.write(out)?;
    if let Some(storage) = &report.storage {
        writeln!(
            out,
            "storage below: {} keys held ({} at start); writing {}, waiting {}, bringing back {}",
            storage.held,
            storage.held_at_start,
            storage.writing,
            storage.waiting,
            storage.promoting
        )?;
        writeln!(
            out,
            "  written {} (failed {}, dropped unwritten {}); brought back {} (missed {}, failed \
             {}, no room {})",
            storage.puts,
            storage.puts_failed,
            storage.puts_skipped,
            storage.promoted,
            storage.promotions_missed,
            storage.promotions_failed,
            storage.promotions_refused
        )?;
    }
    Ok(())
}
