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
//! checking the copies) are only made while no copy into that block is in flight. Every access
//! to the arenas is atomic ([`Arena::read_data`], [`Arena::write_data`]), so an engine that
//! breaks the protocol and races a worker on one block gets wrong bytes, never undefined
//! behaviour: these safe functions are sound whatever the caller and the workers do.

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
        self.device.write_data(offset, bytes).expect(
            "a region beyond the arena after new() checked the layout is a programming error",
        );
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
        self.device.read_data(offset, out).expect(
            "a region beyond the arena after new() checked the layout is a programming error",
        );
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
        host.read_data(offset as usize, out).expect(
            "a region beyond the arena after new() checked the layout is a programming error",
        );
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
