//! The control segment's layout: its header and where every area lies.
//!
//! ```text
//! 0                  Header (magic, version, record sizes, creator, config, offsets, ready)
//! counters           Counters            (COUNTER_SLOTS x u64)
//! control            ControlArea         (kvctl reset / snapshot requests)
//! snapshot           SNAPSHOT_BYTES      (tree JSON written by the scheduler)
//! worker_slots       WorkerSlot x tp_size
//! scheduler_doorbell Doorbell            (workers ring it after pushing completions)
//! rank_areas         tp_size x rank area, `rank_area_stride` apart:
//!     command_ring       ring of CommandSlot   (scheduler -> worker)
//!     completion_ring    ring of Completion    (worker -> scheduler)
//!     command_doorbell   Doorbell              (the worker sleeps on it)
//!     progress           ProgressEntry x completion_ring_slots
//!     device_handles     DeviceHandleArea + DeviceRegionHandle x regions
//! ```
//!
//! Everything is `#[repr(C)]`, every area starts on a cache line, and the header holds offsets, never
//! pointers. [`SegmentLayout::compute`] derives all offsets from a validated [`SegmentConfig`]; the
//! creator stores them in the header and an attacher recomputes them and refuses a header whose
//! offsets disagree, so no offset read from shared memory is ever used unchecked.
//!
//! Flow of creation (see `segment`): 1. compute the layout; 2. write the creator identity first (so
//! that a half-written segment can be judged stale), then the other [`HeaderFields`]; 3. initialise
//! the areas; 4. store [`READY`] into `ready` with Release.

use bytemuck::{Pod, Zeroable};

use crate::config::{ConfigError, SegmentConfig};
use crate::control::{ControlArea, SNAPSHOT_BYTES};
use crate::counters::Counters;
use crate::device_handles::{DeviceHandleArea, DeviceRegionHandle};
use crate::doorbell::Doorbell;
use crate::liveness::ProcessIdentity;
use crate::progress::ProgressEntry;
use crate::record::{CommandSlot, Completion};
use crate::ring;
use crate::sync::{AtomicU32, AtomicU64};
use crate::worker_slot::WorkerSlot;

/// "KVSHMSEG", little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"KVSHMSEG");
/// Bumped on any change of a record, an area or their order.
pub const LAYOUT_VERSION: u32 = 3;
/// The value of `ready` once the creator finished initialising (not 1, so that stray bytes are
/// unlikely to look ready).
pub const READY: u32 = 0x5245_4459; // "READY" in spirit: 'R' 'E' 'D' 'Y'
/// Value of the ready word once the creator has shut the segment down cleanly: attachers refuse it
/// as not ready, and attached workers read it as "the scheduler is gone".
pub const CLOSED: u32 = 0x434C_4F53; // 'C' 'L' 'O' 'S'

const CACHE_LINE: usize = 64;
const PAGE: usize = 4096;

/// The size of every record type, as built into the creator.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct RecordSizes {
    pub header: u32,
    pub config: u32,
    pub process_identity: u32,
    pub command_slot: u32,
    pub completion: u32,
    pub worker_slot: u32,
    pub counters: u32,
    pub control_area: u32,
    pub progress_entry: u32,
    pub device_handle_area: u32,
    pub device_region_handle: u32,
    pub doorbell: u32,
}

const _: () = assert!(size_of::<RecordSizes>() == 48);

impl RecordSizes {
    /// The sizes this build uses.
    pub const CURRENT: RecordSizes = RecordSizes {
        header: size_of::<Header>() as u32,
        config: size_of::<SegmentConfig>() as u32,
        process_identity: size_of::<ProcessIdentity>() as u32,
        command_slot: size_of::<CommandSlot>() as u32,
        completion: size_of::<Completion>() as u32,
        worker_slot: size_of::<WorkerSlot>() as u32,
        counters: size_of::<Counters>() as u32,
        control_area: size_of::<ControlArea>() as u32,
        progress_entry: size_of::<ProgressEntry>() as u32,
        device_handle_area: size_of::<DeviceHandleArea>() as u32,
        device_region_handle: size_of::<DeviceRegionHandle>() as u32,
        doorbell: size_of::<Doorbell>() as u32,
    };

    /// The first record whose size differs from `expected`: (name, found, expected).
    pub fn first_mismatch(&self, expected: &RecordSizes) -> Option<(&'static str, u32, u32)> {
        let pairs = [
            ("Header", self.header, expected.header),
            ("SegmentConfig", self.config, expected.config),
            ("ProcessIdentity", self.process_identity, expected.process_identity),
            ("CommandSlot", self.command_slot, expected.command_slot),
            ("Completion", self.completion, expected.completion),
            ("WorkerSlot", self.worker_slot, expected.worker_slot),
            ("Counters", self.counters, expected.counters),
            ("ControlArea", self.control_area, expected.control_area),
            ("ProgressEntry", self.progress_entry, expected.progress_entry),
            ("DeviceHandleArea", self.device_handle_area, expected.device_handle_area),
            ("DeviceRegionHandle", self.device_region_handle, expected.device_region_handle),
            ("Doorbell", self.doorbell, expected.doorbell),
        ];
        pairs.into_iter().find(|(_, found, expected)| found != expected)
    }
}

/// Byte offsets of the areas, from the start of the segment (rank-area members: from the start of
/// each rank area).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct AreaOffsets {
    pub counters: u64,
    pub control: u64,
    pub snapshot: u64,
    pub worker_slots: u64,
    pub scheduler_doorbell: u64,
    pub rank_areas: u64,
    pub rank_area_stride: u64,
    pub command_ring: u64,
    pub command_ring_len: u64,
    pub completion_ring: u64,
    pub completion_ring_len: u64,
    pub command_doorbell: u64,
    pub progress: u64,
    pub device_handles: u64,
    pub reserved: [u64; 2],
}

const _: () = assert!(size_of::<AreaOffsets>() == 128);

impl AreaOffsets {
    /// Each field with its name, for error messages.
    pub fn named(&self) -> [(&'static str, u64); 14] {
        [
            ("counters", self.counters),
            ("control", self.control),
            ("snapshot", self.snapshot),
            ("worker_slots", self.worker_slots),
            ("scheduler_doorbell", self.scheduler_doorbell),
            ("rank_areas", self.rank_areas),
            ("rank_area_stride", self.rank_area_stride),
            ("command_ring", self.command_ring),
            ("command_ring_len", self.command_ring_len),
            ("completion_ring", self.completion_ring),
            ("completion_ring_len", self.completion_ring_len),
            ("command_doorbell", self.command_doorbell),
            ("progress", self.progress),
            ("device_handles", self.device_handles),
        ]
    }
}

/// The header words that never change after creation; attachers copy them out and validate the copy.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct HeaderFields {
    pub magic: u64,
    pub layout_version: u32,
    pub reserved0: u32,
    pub record_sizes: RecordSizes,
    pub total_size: u64,
    pub creator: ProcessIdentity,
    pub config: SegmentConfig,
    pub offsets: AreaOffsets,
}

const _: () = assert!(size_of::<HeaderFields>() == 280);
// The creator identity is written first and read from half-initialised segments at this offset.
const _: () = assert!(std::mem::offset_of!(HeaderFields, creator) == 72);

/// The segment header as it lies at offset 0.
#[repr(C, align(64))]
pub struct Header {
    pub fields: HeaderFields,
    /// Bumped by the scheduler on reset; commands carry it.
    pub generation: AtomicU64,
    /// [`READY`] once initialised; stored last, with Release.
    pub ready: AtomicU32,
    _reserved: [u32; 7],
}

const _: () = assert!(size_of::<Header>() == 320);
const _: () = assert!(std::mem::offset_of!(Header, fields) == 0);
const _: () = assert!(std::mem::offset_of!(Header, generation) == 280);
const _: () = assert!(std::mem::offset_of!(Header, ready) == 288);

/// Where everything lies, derived from a configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentLayout {
    pub offsets: AreaOffsets,
    /// Bytes of the whole segment (a multiple of the page size).
    pub total_size: usize,
    pub tp_size: usize,
    pub regions: usize,
    pub completion_ring_slots: usize,
}

fn round_up(value: usize, to: usize) -> usize {
    value.div_ceil(to) * to
}

impl SegmentLayout {
    /// Computes the layout of a segment with `config`, after validating it.
    pub fn compute(config: &SegmentConfig) -> Result<SegmentLayout, ConfigError> {
        config.validate()?;
        let tp_size = config.tp_size as usize;
        let regions = config.regions as usize;
        let completion_ring_slots = config.completion_ring_slots as usize;
        let mut cursor = 0usize;
        let mut place = |bytes: usize| {
            let at = cursor;
            cursor = round_up(cursor + bytes, CACHE_LINE);
            at as u64
        };
        place(size_of::<Header>());
        let counters = place(size_of::<Counters>());
        let control = place(size_of::<ControlArea>());
        let snapshot = place(SNAPSHOT_BYTES);
        let worker_slots = place(size_of::<WorkerSlot>() * tp_size);
        let scheduler_doorbell = place(size_of::<Doorbell>());
        let rank_areas = place(0);

        let mut rank_cursor = 0usize;
        let mut place_in_rank = |bytes: usize| {
            let at = rank_cursor;
            rank_cursor = round_up(rank_cursor + bytes, CACHE_LINE);
            at as u64
        };
        let command_ring_len = ring::memory_size::<CommandSlot>(config.command_ring_slots as usize);
        let completion_ring_len = ring::memory_size::<Completion>(completion_ring_slots);
        let command_ring = place_in_rank(command_ring_len);
        let completion_ring = place_in_rank(completion_ring_len);
        let command_doorbell = place_in_rank(size_of::<Doorbell>());
        let progress = place_in_rank(size_of::<ProgressEntry>() * completion_ring_slots);
        let device_handles = place_in_rank(
            size_of::<DeviceHandleArea>() + size_of::<DeviceRegionHandle>() * regions,
        );
        let rank_area_stride = place_in_rank(0);

        let total_size = round_up(rank_areas as usize + rank_area_stride as usize * tp_size, PAGE);
        let offsets = AreaOffsets {
            counters,
            control,
            snapshot,
            worker_slots,
            scheduler_doorbell,
            rank_areas,
            rank_area_stride,
            command_ring,
            command_ring_len: command_ring_len as u64,
            completion_ring,
            completion_ring_len: completion_ring_len as u64,
            command_doorbell,
            progress,
            device_handles,
            reserved: [0; 2],
        };
        Ok(SegmentLayout { offsets, total_size, tp_size, regions, completion_ring_slots })
    }

    /// Offset of rank `rank`'s area.
    pub fn rank_area(&self, rank: usize) -> usize {
        self.offsets.rank_areas as usize + rank * self.offsets.rank_area_stride as usize
    }

    /// The first offset in `found` that differs from this layout: (name, found, expected).
    pub fn first_offset_mismatch(&self, found: &AreaOffsets) -> Option<(&'static str, u64, u64)> {
        found
            .named()
            .into_iter()
            .zip(self.offsets.named())
            .find(|((_, found), (_, expected))| found != expected)
            .map(|((name, found), (_, expected))| (name, found, expected))
            .or_else(|| (found.reserved != [0; 2]).then_some(("reserved", 1, 0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn areas_are_cache_line_aligned_and_inside_the_segment() {
        let config =
            SegmentConfig { tp_size: 3, regions: 6, layers: 3, ..SegmentConfig::default() };
        let layout = SegmentLayout::compute(&config).unwrap();
        for (name, offset) in layout.offsets.named() {
            if !name.ends_with("_len") {
                assert_eq!(offset % 64, 0, "{name}");
            }
        }
        let last_rank_end = layout.rank_area(2) + layout.offsets.rank_area_stride as usize;
        assert!(last_rank_end <= layout.total_size);
        assert_eq!(layout.total_size % 4096, 0);
        assert!(layout.offsets.worker_slots + 3 * 64 <= layout.offsets.scheduler_doorbell);
    }

    #[test]
    fn offsets_that_differ_are_named() {
        let layout = SegmentLayout::compute(&SegmentConfig::default()).unwrap();
        let mut offsets = layout.offsets;
        assert_eq!(layout.first_offset_mismatch(&offsets), None);
        offsets.progress += 64;
        assert_eq!(
            layout.first_offset_mismatch(&offsets),
            Some(("progress", layout.offsets.progress + 64, layout.offsets.progress))
        );
    }

    #[test]
    fn record_size_mismatches_name_the_record() {
        let mut sizes = RecordSizes::CURRENT;
        assert_eq!(sizes.first_mismatch(&RecordSizes::CURRENT), None);
        sizes.completion = 40;
        assert_eq!(sizes.first_mismatch(&RecordSizes::CURRENT), Some(("Completion", 40, 32)));
    }
}
