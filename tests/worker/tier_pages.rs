//! Which pages a worker's host tier is in, with real processes: huge pages where the kernel gives
//! them (the worker maps each with one PMD entry), small pages, and a serving worker all the same,
//! where they are refused.

use std::time::Duration;

use kvshm::manager::CacheConfig;
use kvshm::service::{RankState, Service, ServiceConfig};
use kvshm_ipc::huge_pages::{self, Settings};
use kvshm_ipc::name::SegmentName;

use crate::support::*;

const WAIT: Duration = Duration::from_secs(60);
const HOST_TIER_MIB: u32 = 64;

/// Creates a service with a host tier of [`HOST_TIER_MIB`] MiB, starts its worker, and returns
/// the bytes of the worker's mapping of the tier that PMD entries map, and the bytes that could be.
fn serving_worker_huge_bytes(name: &SegmentName) -> (u64, u64) {
    let cache = CacheConfig::new(16, 16).with_host_blocks(HOST_TIER_MIB);
    let mut service = Service::create(name, ServiceConfig::new(cache, 1, 1, 2, 512 * 1024))
        .expect("creating the service");
    let worker = WorkerProcess::spawn(name, 0, None);
    service.wait_for_workers(WAIT).expect("the worker comes up");
    assert_eq!(service.rank_states(), [RankState::Up { pid: worker.pid() }]);
    let path = format!("/dev/shm{}", name.host_tier_object(0));
    let huge = huge_pages::mapped_huge_bytes_of(worker.pid(), &path)
        .expect("the serving worker maps its host tier");
    // The tier's object: a header page, then the blocks; its whole huge pages can be huge.
    let object_bytes = kvshm_ipc::arena::ARENA_DATA_OFFSET + (u64::from(HOST_TIER_MIB) << 20);
    let pmd = huge_pages::pmd_bytes().unwrap_or(2 << 20) as u64;
    (huge, object_bytes / pmd * pmd)
}

#[test]
fn a_workers_host_tier_is_in_huge_pages_where_the_kernel_gives_them() {
    let settings = Settings::read();
    let (huge, whole_huge_pages) = serving_worker_huge_bytes(&unique_name("huge-tier"));
    let expected = if settings.gives_huge_pages() { whole_huge_pages } else { 0 };
    assert_eq!(huge, expected, "this machine: {settings}");
}

/// The service and its worker run in a child process with huge pages turned off (what a system
/// without them looks like): the tier is in small pages and the worker serves.
#[test]
fn a_workers_host_tier_falls_back_to_small_pages_where_huge_ones_are_refused() {
    let test = "a_workers_host_tier_falls_back_to_small_pages_where_huge_ones_are_refused";
    if !in_child_with_small_pages(module_path!(), test) {
        return;
    }
    let settings = Settings::read();
    assert!(!settings.gives_huge_pages(), "{settings}");
    let (huge, _) = serving_worker_huge_bytes(&unique_name("small-tier"));
    assert_eq!(huge, 0, "this machine: {settings}");
}
