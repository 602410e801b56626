//! The arenas a worker's rank copies between, opened at its start ([`super::process`], step 3):
//! the segment's device arena (host backend), and its host tier, which is the segment's own
//! arena or, for an engine on a shared tier, that tier's arena of the engine's rank (checked to
//! be the one the engine maps: every rank's arena of a tier has one shape).

use kvshm_ipc::arena::{Arena, ArenaKind};
use kvshm_ipc::mappers::Mappers;
use kvshm_ipc::segment::Segment;

use super::geometry::Geometry;
use super::process::{StartError, WorkerOptions};
use crate::offload::shared::open_rank_arena;

/// The `kind` arena of `rank` of the worker's segment.
pub(super) fn open_arena(
    segment: &Segment,
    kind: ArenaKind,
    rank: u32,
) -> Result<Arena, StartError> {
    segment.open_arena(kind, rank).map_err(|reason| StartError::Arena {
        tier: kind.name(),
        rank,
        reason,
    })
}

/// The rank's host tier: the segment's arena, or the shared tier's (checked to hold the
/// segment's host blocks) when the segment's host tier is one; `None` when the segment has none
/// (every host id is then refused).
pub(super) fn open_host_tier(
    segment: &Segment,
    geometry: &Geometry,
    options: &WorkerOptions,
) -> Result<Option<Arena>, StartError> {
    let (name, rank) = (&options.name, options.rank);
    match (segment.config().host_tier_is_shared(), &options.shared_tier) {
        (true, Some((tier, tier_rank))) => {
            let blocks = u64::from(geometry.host_blocks());
            let arena = open_rank_arena(tier, *tier_rank, blocks, geometry.block_bytes())
                .map_err(|reason| StartError::SharedTier { rank: *tier_rank, reason })?;
            // Every rank's arena of a tier has one shape: only the engine that made the segment
            // (it maps its rank's arena for as long as it runs) tells this rank's apart.
            let engine = segment.creator().pid;
            let object = ArenaKind::Host.object(tier, *tier_rank);
            if !Mappers::scan().of(&object).contains(&engine) {
                return Err(StartError::SharedTierNotTheEngines {
                    name: name.clone(),
                    tier: tier.clone(),
                    rank: *tier_rank,
                    engine,
                });
            }
            Ok(Some(arena))
        }
        (true, None) => Err(StartError::SharedTierNotGiven { name: name.clone() }),
        (false, Some((tier, _))) => {
            Err(StartError::SharedTierNotUsed { name: name.clone(), tier: tier.clone() })
        }
        (false, None) if geometry.host_blocks() == 0 => Ok(None),
        (false, None) => open_arena(segment, ArenaKind::Host, rank).map(Some),
    }
}
