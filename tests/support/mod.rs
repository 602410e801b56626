//! Support shared by the test binaries of every layer (`tests/cli`, `tests/offload`,
//! `tests/scheduler`, `tests/service`, `tests/storage`, `tests/worker`), each of which includes
//! it as its one `support` module:
//!
//! - [`scheduler`]: a tiny engine driving a cache manager alone, and the scheduler tests'
//!   shared set-ups (not re-exported at the top: its names are the scheduler tests' own);
//! - [`service`]: `kvshm worker` processes beside a service or a transport, block bytes written
//!   and checked through the ranks' memory, requests run end to end, polls until a condition;
//! - [`ring_driver`]: the scheduler's side of one rank's rings, for tests without a service;
//! - [`storage_worker`]: workers with a storage tier, driven through [`RankDriver`], and segment
//!   configurations for them;
//! - [`redis_server`]: private Redis servers, or the run's shared one;
//! - [`blocks`]: the bytes and storage entries of the storage tests' blocks;
//! - [`scratch`]: scratch directories;
//! - [`rng`]: a seeded generator for randomized tests;
//! - [`traces`]: the traces the repository carries.
//!
//! Names in shared memory, Redis namespaces and scratch directories all take a serial number
//! from [`serial`], with the process id, so that no two tests (or test runs) share one.
#![allow(dead_code, unused_imports)]

pub mod blocks;
pub mod redis_server;
pub mod ring_driver;
pub mod rng;
pub mod scheduler;
pub mod scratch;
pub mod service;
pub mod storage_worker;
pub mod traces;

pub use blocks::*;
pub use redis_server::*;
pub use ring_driver::*;
pub use rng::*;
pub use scratch::*;
pub use service::*;
pub use storage_worker::*;
pub use traces::*;

use kvshm_ipc::name::SegmentName;
use kvshm_ipc::sync::{AtomicU32, Ordering};

/// A number no earlier call in this process returned.
pub fn serial() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A segment name no other test (or test run) uses.
pub fn unique_name(test: &str) -> SegmentName {
    SegmentName::new(&format!("t-{test}-{}-{}", std::process::id(), serial()))
        .expect("valid test name")
}

/// This test binary, run again to play another process for test `test` of the calling module
/// (`module`: its `module_path!()`): `--exact` with the test's whole path selects it alone.
pub fn rerun_test(module: &str, test: &str) -> std::process::Command {
    let path = match module.split_once("::") {
        Some((_, within)) => format!("{within}::{test}"),
        None => test.to_owned(),
    };
    let mut command = std::process::Command::new(std::env::current_exe().unwrap());
    command.args(["--exact", &path, "--nocapture"]);
    command
}

/// Set in the child of [`in_child_with_small_pages`].
const SMALL_PAGES_CHILD: &str = "KVSHM_TEST_SMALL_PAGES_CHILD";

/// For a test about a slow set-up (a large tier mapped in 4 KiB pages, as on a system without
/// huge pages): in the test's own process, runs it again in a child with huge pages turned off,
/// asserts that it passed there, and returns `false`; in that child, returns `true`, and the test
/// goes on. (Turning huge pages off in the test's own process would change the tiers of the tests
/// beside it.)
pub fn in_child_with_small_pages(module: &str, test: &str) -> bool {
    if std::env::var_os(SMALL_PAGES_CHILD).is_some() {
        kvshm_ipc::huge_pages::refuse_in_this_process(true).expect("turning huge pages off");
        return true;
    }
    let output = rerun_test(module, test)
        .env(SMALL_PAGES_CHILD, "1")
        .output()
        .expect("running the test again in a child");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "the test failed in small pages:\n{stdout}\n{stderr}");
    assert!(stdout.contains("1 passed"), "the child ran no test:\n{stdout}\n{stderr}");
    eprintln!("{stderr}");
    false
}
