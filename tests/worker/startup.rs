//! A worker's set-up judged on progress, with real processes: a worker mapping a large tier on a
//! CPU that sixteen other processes keep busy comes up (each step of its set-up can take a
//! hundred milliseconds there, the serving heartbeat limit), while a worker stopped in the middle
//! of its set-up is still fenced. Both run with the tier in 4 KiB pages, as on a system without
//! huge pages, where the set-up is slow (in huge pages it takes milliseconds).

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvshm::manager::CacheConfig;
use kvshm::service::{RankState, Service, ServiceConfig};
use kvshm_ipc::liveness::monotonic_ns;
use kvshm_ipc::worker_slot::SETUP_HEARTBEAT_TIMEOUT;

use crate::support::*;

const WAIT: Duration = Duration::from_secs(60);
/// Busy processes sharing the worker's CPU.
const BUSY_LOOPS: usize = 16;

/// A service of one rank whose tiers hold `host_mib` MiB of host blocks (1 MiB each) and 16 device
/// blocks: the worker maps all of them in before it serves.
fn service(name: &kvshm_ipc::name::SegmentName, host_mib: u32) -> Service {
    let cache = CacheConfig::new(16, 16).with_host_blocks(host_mib);
    Service::create(name, ServiceConfig::new(cache, 1, 1, 2, 512 * 1024))
        .expect("creating the service")
}

/// Runs `command` on CPU 0 only.
fn on_cpu_zero(command: &mut Command) -> &mut Command {
    // SAFETY: the closure runs in the forked child before exec and only calls
    // sched_setaffinity, which is async-signal-safe, on a set on its own stack.
    unsafe {
        command.pre_exec(|| {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(0, &mut set);
            if libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        })
    }
}

/// Processes spinning on CPU 0; killed when dropped.
struct BusyLoops(Vec<Child>);

impl BusyLoops {
    fn start(count: usize) -> BusyLoops {
        let spin = || {
            let mut command = Command::new("sh");
            command.args(["-c", "while :; do :; done"]).stdin(Stdio::null());
            // SAFETY: the closure runs in the forked child before exec and only calls prctl,
            // which is async-signal-safe. A test killed before its drop (a CI run stopped)
            // must not leave the loops spinning on CPU 0 under every later test.
            unsafe {
                command.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                });
            }
            on_cpu_zero(&mut command).spawn().expect("spawning a busy loop")
        };
        BusyLoops((0..count).map(|_| spin()).collect())
    }
}

impl Drop for BusyLoops {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn worker_on_cpu_zero(name: &kvshm_ipc::name::SegmentName) -> WorkerProcess {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kvshm"));
    command
        .args(["worker", "--name", name.as_str(), "--rank", "0", "--attach-timeout", "60"])
        .env_remove("KVSHM_WORKER_LAYER_DELAY_US")
        .env_remove("KVSHM_WORKER_COPY_RATE")
        .stdin(Stdio::null());
    WorkerProcess { child: on_cpu_zero(&mut command).spawn().expect("spawning kvshm worker") }
}

#[test]
fn a_worker_setting_up_on_a_cpu_saturated_by_other_processes_comes_up() {
    let test = "a_worker_setting_up_on_a_cpu_saturated_by_other_processes_comes_up";
    if !in_child_with_small_pages(module_path!(), test) {
        return;
    }
    let name = unique_name("starved");
    let mut service = service(&name, 256);
    let _busy = BusyLoops::start(BUSY_LOOPS);
    let worker = worker_on_cpu_zero(&name);
    let started = Instant::now();
    service.wait_for_workers(WAIT).expect("the starved worker comes up");
    eprintln!("the worker came up after {:?} sharing its CPU with {BUSY_LOOPS}", started.elapsed());
    assert_eq!(service.stats().worker_deaths, 0, "the worker was fenced while it set up");
    assert_eq!(service.rank_states(), [RankState::Up { pid: worker.pid() }]);
}

#[test]
fn a_worker_stopped_while_it_sets_up_is_still_fenced() {
    if !in_child_with_small_pages(
        module_path!(),
        "a_worker_stopped_while_it_sets_up_is_still_fenced",
    ) {
        return;
    }
    let name = unique_name("stopped-setup");
    // 1 GiB of host tier: hundreds of milliseconds of set-up on an idle machine.
    let mut service = service(&name, 1024);
    let slots = kvshm_ipc::segment::Segment::attach(&name).unwrap();
    let mut worker = WorkerProcess::spawn(&name, 0, None);
    let pid = nix::unistd::Pid::from_raw(worker.pid() as i32);
    // Stop it as soon as it holds the rank, in the middle of mapping its tiers.
    let started = Instant::now();
    while slots.worker_slot(0).unwrap().view().heartbeat_ns == 0 {
        assert!(started.elapsed() < WAIT, "the worker never claimed its rank");
        std::thread::yield_now();
    }
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let stopped = Instant::now();
    let view = slots.worker_slot(0).unwrap().view();
    assert!(!view.serving, "stopped before it served");
    // Its last heartbeat: a stopped process beats no more.
    let last_heartbeat_ns = view.heartbeat_ns;

    while service.stats().worker_deaths == 0 {
        assert!(
            stopped.elapsed() < SETUP_HEARTBEAT_TIMEOUT + Duration::from_secs(10),
            "a worker stopped during its set-up was never fenced: {:?}",
            service.rank_states()
        );
        service.poll();
        std::thread::sleep(Duration::from_millis(5));
    }
    let silent = Duration::from_nanos(monotonic_ns().saturating_sub(last_heartbeat_ns));
    eprintln!("the stopped worker was fenced {silent:?} after its last heartbeat");
    assert!(silent >= SETUP_HEARTBEAT_TIMEOUT, "fenced before the set-up limit: {silent:?}");
    let status = worker.wait_exit(Duration::from_secs(10)).expect("the fenced worker exits");
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(libc::SIGKILL));
    assert_eq!(service.rank_states(), [RankState::Down]);
}
