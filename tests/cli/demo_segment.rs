//! The demo's segment: its default name is unpredictable, a name that someone else holds is
//! refused with an error that names the object and its owner (never taken over or removed), and
//! an interrupted demo (Ctrl-C, a kill) removes its segment instead of leaving it in /dev/shm.
//!
//! "Someone else" is made with a real chown to an unused uid, which needs root; these tests run as
//! root in CI (`scripts/test`) and say so when they cannot.

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};

use kvshm_ipc::listing::SHM_DIR;

/// A uid no process of the test machine runs as.
const STRANGER: u32 = 54_321;

fn demo(extra: &[&str]) -> (Output, u32) {
    let child = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(["demo", "--synthetic", "--limit", "20", "--device-blocks", "64"])
        .args(["--host-blocks", "64", "--tp", "1"])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvshm demo");
    let pid = child.id();
    (child.wait_with_output().expect("wait for kvshm demo"), pid)
}

/// The segment name the demo printed in its first line.
fn segment_name(output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "demo failed: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let first = stdout.lines().next().unwrap_or_default();
    let name = first.strip_prefix("kvshm demo: segment ").and_then(|rest| rest.split(',').next());
    name.unwrap_or_else(|| panic!("no segment name in {first:?}")).to_owned()
}

#[test]
fn the_default_segment_name_is_not_predictable_from_the_pid() {
    let (first, first_pid) = demo(&[]);
    let (second, _) = demo(&[]);
    let (first, second) = (segment_name(&first), segment_name(&second));
    assert_ne!(first, format!("demo-{first_pid}"));
    assert_ne!(first, second);
    let random = first.rsplit('-').next().unwrap();
    assert!(
        random.len() == 16 && random.chars().all(|c| c.is_ascii_hexdigit()),
        "{first}: no random suffix"
    );
}

fn running_as_root() -> bool {
    let root = nix::unistd::geteuid().is_root();
    if !root {
        eprintln!("not root: cannot give an object to another uid; this test needs root");
    }
    root
}

#[test]
fn a_name_whose_objects_another_user_created_is_refused_naming_the_object_and_its_owner() {
    if !running_as_root() {
        return;
    }
    for (tag, suffix) in [("control", ""), ("host", ".host.0")] {
        let name = format!("planted-{tag}-{}", std::process::id());
        let object = format!("/kvshm.{name}{suffix}");
        let path = format!("{SHM_DIR}{object}");
        std::fs::write(&path, b"planted").unwrap();
        std::os::unix::fs::chown(&path, Some(STRANGER), Some(STRANGER)).unwrap();

        let (output, _) = demo(&["--name", &name]);
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        let kept = std::fs::read(&path).ok();
        let _ = std::fs::remove_file(&path);
        assert!(!output.status.success(), "the demo ran over {object}");
        assert!(stderr.contains(&object), "{object}: {stderr}");
        assert!(stderr.contains(&format!("uid {STRANGER}")), "{object}: {stderr}");
        assert_eq!(kept.as_deref(), Some(&b"planted"[..]), "{object} was touched");
        let leftovers: Vec<_> = std::fs::read_dir(SHM_DIR)
            .unwrap()
            .flatten()
            .filter(|entry| entry.file_name().to_string_lossy().contains(&name))
            .collect();
        assert!(leftovers.is_empty(), "the demo left {leftovers:?}");
    }
}

#[test]
fn an_interrupted_demo_removes_its_segment() {
    let name = format!("interrupted-{}", std::process::id());
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(["demo", "--synthetic", "--limit", "20", "--device-blocks", "64"])
        .args(["--host-blocks", "64", "--tp", "1", "--hold", "600", "--name", &name])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvshm demo");
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("holding segment") {
        line.clear();
        assert_ne!(stderr.read_line(&mut line).unwrap(), 0, "the demo ended before holding");
    }
    let control = format!("{SHM_DIR}/kvshm.{name}");
    assert!(std::path::Path::new(&control).exists());
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let status = child.wait().unwrap();
    let leftovers: Vec<_> = std::fs::read_dir(SHM_DIR)
        .unwrap()
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.to_string_lossy().contains(&name))
        .collect();
    for path in &leftovers {
        let _ = std::fs::remove_file(path);
    }
    assert!(status.code().is_some(), "the demo died of the signal: {status}");
    assert!(leftovers.is_empty(), "the interrupted demo left {leftovers:?}");
}

#[test]
fn the_demo_serves_with_the_eviction_policy_it_is_given() {
    let (output, _) = demo(&["--eviction", "conv"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    segment_name(&output); // succeeded
    let first = stdout.lines().next().unwrap_or_default();
    assert!(first.ends_with("conv eviction"), "{first}");
}
