//! Listing what a Redis storage tier holds for a namespace and layout, for a scheduler that
//! starts (or restarts) and wants to hit blocks other services, or its own earlier runs, stored.
//!
//! Flow ([`blocks_on_every_rank`]):
//! 1. `SCAN MATCH kvshm:NAMESPACE:LAYOUT:*:0`: the keys of rank 0's parts;
//! 2. per batch, pipelined `GETRANGE key 0 79`: each value's header, which names the block, its
//!    parent and its depth; a header that is not a valid header of this layout and rank is
//!    skipped (a damaged value is a miss when loaded, never listed as good);
//! 3. pipelined `EXISTS` of the other ranks' keys: a block is listed only if every rank has its
//!    part (values may still vanish later: a LOAD then misses, counted);
//! 4. the blocks ordered by depth, parents first, as `disk_index::blocks_on_every_rank` orders
//!    them.

use std::time::Duration;

use super::backend::BlockLayout;
use super::disk_index::IndexedBlock;
use super::format::{
    join_hash, LayoutTag, ValueHeader, VALUE_HEADER_BYTES, VALUE_MAGIC, VALUE_VERSION,
};
use super::redis::{block_key, key_prefix};

/// Keys asked for per `SCAN` call, and headers read per pipeline.
const BATCH: usize = 1000;

/// The blocks every rank holds under `namespace` in the Redis at `url` for `layout` (module
/// flow). Metadata only: no block bytes are read.
pub fn blocks_on_every_rank(
    url: &str,
    namespace: &str,
    layout: &BlockLayout,
    timeout: Duration,
) -> Result<Vec<IndexedBlock>, redis::RedisError> {
    let client = redis::Client::open(url)?;
    let mut connection = client.get_connection_with_timeout(timeout)?;
    connection.set_read_timeout(Some(timeout))?;
    connection.set_write_timeout(Some(timeout))?;
    let prefix = key_prefix(namespace, layout);
    let pattern = format!("{prefix}*:0");
    let mut blocks = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(BATCH)
            .query(&mut connection)?;
        for chunk in keys.chunks(BATCH) {
            blocks.extend(listed(&mut connection, &prefix, layout, chunk)?);
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
    blocks.sort_by_key(|block: &IndexedBlock| (block.depth, block.hash));
    blocks.dedup_by_key(|block| block.hash);
    Ok(blocks)
}

/// The blocks of rank-0 `keys` whose header is valid and whose every rank has its part.
fn listed(
    connection: &mut redis::Connection,
    prefix: &str,
    layout: &BlockLayout,
    keys: &[String],
) -> Result<Vec<IndexedBlock>, redis::RedisError> {
    let mut pipe = redis::pipe();
    for key in keys {
        pipe.cmd("GETRANGE").arg(key).arg(0).arg(VALUE_HEADER_BYTES - 1);
    }
    let headers: Vec<Vec<u8>> = pipe.query(connection)?;
    let tag = LayoutTag::of(layout);
    let candidates: Vec<IndexedBlock> = headers
        .iter()
        .filter(|bytes| bytes.len() == VALUE_HEADER_BYTES)
        .map(|bytes| bytemuck::pod_read_unaligned::<ValueHeader>(bytes))
        .filter(|header| {
            header.magic == VALUE_MAGIC
                && header.version == VALUE_VERSION
                && header.rank == 0
                && header.layout == tag
        })
        .map(|header| IndexedBlock {
            hash: join_hash(header.hash),
            parent: join_hash(header.parent),
            depth: header.depth,
            sequence: 0,
        })
        .collect();
    if layout.tp_size <= 1 || candidates.is_empty() {
        return Ok(candidates);
    }
    let mut pipe = redis::pipe();
    for block in &candidates {
        for rank in 1..layout.tp_size {
            pipe.cmd("EXISTS").arg(block_key(prefix, block.hash, rank));
        }
    }
    let present: Vec<u8> = pipe.query(connection)?;
    let others = (layout.tp_size - 1) as usize;
    Ok(candidates
        .into_iter()
        .zip(present.chunks(others))
        .filter(|(_, present)| present.iter().all(|&exists| exists == 1))
        .map(|(block, _)| block)
        .collect())
}
