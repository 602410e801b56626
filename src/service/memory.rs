//! The engine's view of one rank's block bytes on the host backend.
//!
//! On the host backend the "device" tier is a shared-memory arena per rank, and the engine (the
//! demo, the tests) reads and writes its KV blocks there, just as a real engine's kernels do in
//! GPU memory; the host tier is another shared-memory arena per rank that only workers write.
//! [`RankMemory`] copies region bytes in and out, bounds-checked through the same layouts the
//! worker copies with ([`DeviceLayout::packed`], [`HostLayout`]), so the two sides cannot disagree
//! about where a block lives.
//!
//! The protocol keeps the engine and the workers off each other's bytes: the engine touches a
//! device block only after its ticket is ready and before it finishes the request, and the
//! scheduler never issues a copy into a block a request owns. Reads of the host tier (tests
//! checking the copies) are only made while no copy into that block is in flight.

use kvshm_ipc::arena::Arena;

use crate::worker::{DeviceLayout, Geometry, HostLayout};

/// A block or region outside the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BlockAccessError {
    #[error("{tier} block {block} region {region} is out of range")]
    OutOfRange { tier: &'static str, block: u32, region: u32 },
    #[error("a region holds {expected} bytes, the buffer {found}")]
    WrongLength { expected: u64, found: usize },
    #[error("the {tier} arena is smaller ({len} bytes) than its layout ({needed} bytes)")]
    ArenaTooSmall { tier: &'static str, len: usize, needed: u64 },
}

/// One rank's device arena and host tier, as the engine reaches them.
pub struct RankMemory {
    device: Arena,
    host: Option<Arena>,
    device_layout: DeviceLayout,
    host_layout: HostLayout,
    region_bytes: u64,
}

impl RankMemory {
    /// Wraps the rank's arenas after checking that they hold the layouts of `geometry`.
    pub fn new(
        geometry: &Geometry,
        device: Arena,
        host: Option<Arena>,
    ) -> Result<RankMemory, BlockAccessError> {
        let device_layout = DeviceLayout::packed(geometry);
        let host_layout = HostLayout::new(geometry);
        if (device.data_len() as u64) < device_layout.end() {
            return Err(BlockAccessError::ArenaTooSmall {
                tier: "device",
                len: device.data_len(),
                needed: device_layout.end(),
            });
        }
        if let Some(host) = &host {
            if (host.data_len() as u64) < host_layout.len() {
                return Err(BlockAccessError::ArenaTooSmall {
                    tier: "host",
                    len: host.data_len(),
                    needed: host_layout.len(),
                });
            }
        }
        Ok(RankMemory {
            device,
            host,
            device_layout,
            host_layout,
            region_bytes: geometry.region_bytes(),
        })
    }

    pub fn region_bytes(&self) -> u64 {
        self.region_bytes
    }

    /// Writes `bytes` into region `region` of device block `block`.
    pub fn write_device_region(
        &self,
        block: u32,
        region: u32,
        bytes: &[u8],
    ) -> Result<(), BlockAccessError> {
        let offset = self.device_offset(block, region, bytes.len())?;
        // SAFETY: 1. offset + region_bytes <= device_layout.end() <= the arena's data length
        // (checked in new() and by the layout); 2. bytes.len() == region_bytes; 3. `bytes` is the
        // caller's memory, not the arena, so they do not overlap; 4. the arena is shared memory
        // that worker processes also copy, as plain bytes for which every value is valid; this
        // safe function cannot stop a misbehaving engine from racing a worker on one block, which
        // would make the bytes wrong (the protocol in the module documentation prevents it), not
        // this copy out of bounds.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.device.data_ptr().add(offset),
                bytes.len(),
            );
        }
        Ok(())
    }

    /// Reads region `region` of device block `block` into `out`.
    pub fn read_device_region(
        &self,
        block: u32,
        region: u32,
        out: &mut [u8],
    ) -> Result<(), BlockAccessError> {
        let offset = self.device_offset(block, region, out.len())?;
        // SAFETY: as in write_device_region, with source and destination swapped.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.device.data_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            );
        }
        Ok(())
    }

    /// Reads region `region` of host block `block` into `out`.
    pub fn read_host_region(
        &self,
        block: u32,
        region: u32,
        out: &mut [u8],
    ) -> Result<(), BlockAccessError> {
        let out_of_range = BlockAccessError::OutOfRange { tier: "host", block, region };
        let host = self.host.as_ref().ok_or(out_of_range)?;
        self.check_len(out.len())?;
        let offset = self.host_layout.region_offset(block, region).ok_or(out_of_range)?;
        // SAFETY: 1. offset + region_bytes <= host_layout.len() <= the arena's data length
        // (checked in new()) and out.len() == region_bytes (check_len); 2. `out` is the caller's
        // memory, so the ranges do not overlap; 3. as premise 4 of write_device_region: plain
        // bytes a worker may be writing, which a read during a copy would see torn, never out of
        // bounds (the module documentation says when reads are made).
        unsafe {
            std::ptr::copy_nonoverlapping(
                host.data_ptr().add(offset as usize),
                out.as_mut_ptr(),
                out.len(),
            );
        }
        Ok(())
    }

    fn device_offset(
        &self,
        block: u32,
        region: u32,
        len: usize,
    ) -> Result<usize, BlockAccessError> {
        self.check_len(len)?;
        self.device_layout
            .region_offset(block, region)
            .map(|offset| offset as usize)
            .ok_or(BlockAccessError::OutOfRange { tier: "device", block, region })
    }

    fn check_len(&self, len: usize) -> Result<(), BlockAccessError> {
        if len as u64 != self.region_bytes {
            return Err(BlockAccessError::WrongLength { expected: self.region_bytes, found: len });
        }
        Ok(())
    }
}
