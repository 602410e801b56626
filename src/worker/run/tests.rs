//! The serving loop's idle wait, driven in-process: a segment created by the test, the worker's
//! view of it, a claimed rank and a host engine over its arenas.

use std::time::Duration;

use kvshm_ipc::arena::ArenaKind;
use kvshm_ipc::config::SegmentConfig;
use kvshm_ipc::name::SegmentName;
use nix::sys::signal::Signal;

use super::*;
use crate::worker::geometry::{Geometry, GeometryParams};
use crate::worker::host_engine::{HostCopyEngine, MappedArea};

/// Longer than any test should take: a wait that runs its whole slice has missed its wake-up.
const LONG_SLICE: Duration = Duration::from_secs(20);

fn config() -> SegmentConfig {
    SegmentConfig {
        tp_size: 1,
        device_blocks: 4,
        host_blocks: 4,
        regions: 2,
        layers: 1,
        region_bytes: 256,
        command_ring_slots: 16,
        completion_ring_slots: 4,
        ..SegmentConfig::default()
    }
}

/// Runs `test` with a server over rank 0 of a fresh segment whose creator handle is `creator`.
fn with_server(
    tag: &str,
    stop_requested: &dyn Fn() -> bool,
    test: impl FnOnce(&mut Server<'_>, Segment),
) {
    let name = SegmentName::new(&format!("run-{tag}-{}", std::process::id())).unwrap();
    let creator = Segment::create(&name, &config()).unwrap();
    let segment = Segment::attach(&name).unwrap();
    let claim = segment.claim_rank(0).unwrap();
    let device = segment.open_arena(ArenaKind::Device, 0).unwrap();
    let host = segment.open_arena(ArenaKind::Host, 0).unwrap();
    let c = config();
    let geometry = Geometry::new(GeometryParams {
        layers: c.layers,
        regions: c.regions,
        region_bytes: c.region_bytes,
        device_blocks: c.device_blocks,
        host_blocks: c.host_blocks,
    })
    .unwrap();
    // SAFETY: both arenas outlive the engine (dropped at the end of this function, after it) and
    // no copy runs in these tests.
    let (device_area, host_area) = unsafe {
        (
            MappedArea::new(device.data_ptr(), device.data_len()).unwrap(),
            MappedArea::new(host.data_ptr(), host.data_len()).unwrap(),
        )
    };
    let mut engine = HostCopyEngine::new(geometry, device_area, host_area).unwrap();
    let mut server =
        Server::new(&segment, &claim, &mut engine, stop_requested, ServeOptions::default())
            .unwrap();
    test(&mut server, creator);
}

/// Waits until a waiter sleeps on rank 0's command doorbell, and a little longer, so that it has
/// entered the futex wait itself.
fn wait_for_sleeper(segment: &Segment) {
    let doorbell = segment.command_doorbell(0).unwrap();
    while doorbell.sleepers() == 0 {
        std::thread::yield_now();
    }
    std::thread::sleep(Duration::from_millis(20));
}

#[test]
fn an_idle_wait_ends_when_the_scheduler_closes_the_segment() {
    with_server("closed", &|| false, |server, creator| {
        let observer = Segment::attach(creator.name()).unwrap();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                wait_for_sleeper(&observer);
                drop(creator);
            });
            assert_eq!(server.wait_for_work(LONG_SLICE), WaitOutcome::Ready);
        });
        assert!(observer.is_closed());
    });
}

static STOP: kvshm_ipc::sync::AtomicBool = kvshm_ipc::sync::AtomicBool::new(false);

extern "C" fn set_stop(_signal: libc::c_int) {
    // Only an atomic store: async-signal-safe. Relaxed: the flag carries no other data.
    STOP.store(true, kvshm_ipc::sync::Ordering::Relaxed);
}

#[test]
fn an_idle_wait_ends_when_a_stop_signal_arrives() {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet};

    // As `kvshm worker` installs its stop handler (no SA_RESTART), on a signal no other test uses.
    let action = SigAction::new(SigHandler::Handler(set_stop), SaFlags::empty(), SigSet::empty());
    // SAFETY: the handler only stores to a static atomic (async-signal-safe), and nothing else in
    // this test binary handles SIGUSR2.
    unsafe { sigaction(Signal::SIGUSR2, &action) }.unwrap();
    let stop_requested = || STOP.load(kvshm_ipc::sync::Ordering::Relaxed);
    with_server("stopped", &stop_requested, |server, creator| {
        // SAFETY: pthread_self has no preconditions.
        let waiter = unsafe { libc::pthread_self() };
        std::thread::scope(|scope| {
            scope.spawn(|| {
                wait_for_sleeper(&creator);
                // SAFETY: `waiter` is this test's thread, which outlives the scope.
                assert_eq!(unsafe { libc::pthread_kill(waiter, libc::SIGUSR2) }, 0);
            });
            assert_eq!(server.wait_for_work(LONG_SLICE), WaitOutcome::Ready);
        });
        assert!(!creator.is_closed());
    });
}
