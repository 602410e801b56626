//! Helpers: unique names, objects that clean up after themselves, running kvctl (optionally while
//! the test thread keeps a scheduler polling), and a checker of the Prometheus text format.

use std::collections::{HashMap, HashSet};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use kvshm_ipc::listing;
use kvshm_ipc::name::SegmentName;

/// A segment name no other test (or test run) uses.
pub fn unique_name(tag: &str) -> SegmentName {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let serial = NEXT.fetch_add(1, Ordering::Relaxed);
    SegmentName::new(&format!("kvctl-t{}-{serial}-{tag}", std::process::id())).unwrap()
}

/// Removes every object of a name when dropped, whatever the test left behind and whoever owns
/// it (a test may have given one to another uid, which kvctl and the library never remove).
pub struct Cleanup(pub SegmentName);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let Ok(entries) = std::fs::read_dir(listing::SHM_DIR) else { return };
        for entry in entries.flatten() {
            let file_name = entry.file_name();
            let parsed = file_name.to_str().and_then(kvshm_ipc::name::ObjectName::parse);
            if parsed.is_some_and(|parsed| parsed.segment == self.0) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// The file of a shared-memory object (`/kvshm.NAME` -> `/dev/shm/kvshm.NAME`).
pub fn path(object: &str) -> String {
    format!("{}{object}", listing::SHM_DIR)
}

/// Writes `bytes` as the object `object` (an existing one is replaced).
pub fn write_object(object: &str, bytes: &[u8]) {
    std::fs::write(path(object), bytes).unwrap();
}

/// Makes `object` look untouched for a minute (past any creation grace).
pub fn age_object(object: &str) {
    let file = std::fs::File::options().write(true).open(path(object)).unwrap();
    file.set_modified(SystemTime::now() - Duration::from_secs(60)).unwrap();
}

/// Makes `object` look untouched for a minute without opening it (a FIFO's open would block),
/// and without following it if it is a link.
pub fn age_object_by_path(object: &str) {
    let status =
        Command::new("touch").args(["-h", "-d", "1 minute ago", &path(object)]).status().unwrap();
    assert!(status.success(), "touch {object}");
}

/// Whether anything (a file, a FIFO, a dangling link) has the name `object`.
pub fn exists(object: &str) -> bool {
    std::fs::symlink_metadata(path(object)).is_ok()
}

/// `len` pseudo-random bytes (xorshift, fixed seed): garbage that is the same on every run.
pub fn garbage(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

/// kvctl's exit status and output.
pub struct Run {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    fn from_output(output: Output) -> Run {
        Run {
            success: output.status.success(),
            stdout: String::from_utf8(output.stdout).unwrap(),
            stderr: String::from_utf8(output.stderr).unwrap(),
        }
    }

    /// stdout parsed as the one JSON document it must be.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|error| panic!("not JSON ({error}): {}", self.stdout))
    }

    pub fn assert_ok(&self) -> &Run {
        assert!(self.success, "kvctl failed: {}{}", self.stdout, self.stderr);
        self
    }

    pub fn assert_fails_saying(&self, words: &[&str]) -> &Run {
        assert!(!self.success, "kvctl succeeded: {}", self.stdout);
        for word in words {
            assert!(self.stderr.contains(word), "stderr lacks {word:?}: {}", self.stderr);
        }
        self
    }
}

fn command(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kvctl"));
    command.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    command
}

/// Runs kvctl to completion.
pub fn kvctl(args: &[&str]) -> Run {
    Run::from_output(command(args).output().unwrap())
}

/// Runs kvctl to completion with `env` added to its environment.
pub fn kvctl_with_env(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut command = command(args);
    command.envs(env.iter().copied());
    Run::from_output(command.output().unwrap())
}

/// Runs kvctl, killing it if it has not exited after `limit` (`None`: it had to be killed).
pub fn kvctl_within(args: &[&str], limit: Duration) -> Option<Run> {
    let mut child = command(args).spawn().unwrap();
    let started = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Some(Run::from_output(child.wait_with_output().unwrap()))
}

/// Runs kvctl while calling `poll` on this thread until it exits (the scheduler's side).
pub fn kvctl_while(args: &[&str], mut poll: impl FnMut()) -> Run {
    let child = command(args).spawn().unwrap();
    std::thread::scope(|scope| {
        // A reader thread, so that a large output cannot block the child while we poll.
        let waiter = scope.spawn(move || child.wait_with_output().unwrap());
        while !waiter.is_finished() {
            poll();
            std::thread::sleep(Duration::from_micros(200));
        }
        Run::from_output(waiter.join().unwrap())
    })
}

/// One sample of the Prometheus text format.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: HashMap<String, String>,
    pub value: f64,
}

/// Parses the text exposition format strictly enough to catch mistakes: metric and label names,
/// quoted and escaped label values, numeric values, one HELP and one TYPE per family before its
/// samples, and `_total` on counters. Returns the samples and each family's type.
pub fn parse_prometheus(text: &str) -> Result<(Vec<Sample>, HashMap<String, String>), String> {
    let valid_name = |name: &str| {
        !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    };
    let mut helps = HashSet::new();
    let mut types = HashMap::new();
    let mut samples = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap_or_default();
            if !valid_name(name) || !helps.insert(name.to_owned()) {
                return Err(format!("bad or repeated HELP: {line}"));
            }
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').ok_or(format!("bad TYPE: {line}"))?;
            if !["counter", "gauge", "untyped", "summary", "histogram"].contains(&kind) {
                return Err(format!("unknown type: {line}"));
            }
            if kind == "counter" && !name.ends_with("_total") {
                return Err(format!("counter without _total: {line}"));
            }
            if types.insert(name.to_owned(), kind.to_owned()).is_some() {
                return Err(format!("repeated TYPE: {line}"));
            }
        } else if line.starts_with('#') || line.is_empty() {
            return Err(format!("unexpected line: {line:?}"));
        } else {
            samples.push(parse_sample(line, &types, valid_name)?);
        }
    }
    Ok((samples, types))
}

fn parse_sample(
    line: &str,
    types: &HashMap<String, String>,
    valid_name: impl Fn(&str) -> bool,
) -> Result<Sample, String> {
    let error = || format!("bad sample: {line}");
    let (name, rest) = match line.find('{') {
        Some(open) => (&line[..open], &line[open + 1..]),
        None => line.split_once(' ').ok_or_else(error)?,
    };
    if !valid_name(name) || !types.contains_key(name) {
        return Err(format!("sample of an undeclared or badly named family: {line}"));
    }
    let mut labels = HashMap::new();
    let mut chars = rest.chars().peekable();
    let mut value_text = rest;
    if line.contains('{') {
        loop {
            let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
            if !valid_name(&key) || chars.next() != Some('"') {
                return Err(error());
            }
            let mut value = String::new();
            loop {
                match chars.next().ok_or_else(error)? {
                    '\\' => match chars.next().ok_or_else(error)? {
                        'n' => value.push('\n'),
                        escaped @ ('\\' | '"') => value.push(escaped),
                        _ => return Err(error()),
                    },
                    '"' => break,
                    c => value.push(c),
                }
            }
            labels.insert(key, value);
            match chars.next() {
                Some(',') => continue,
                Some('}') => break,
                _ => return Err(error()),
            }
        }
        let consumed = rest.len() - chars.clone().collect::<String>().len();
        value_text = rest[consumed..].strip_prefix(' ').ok_or_else(error)?;
    }
    let value = value_text.trim().parse().map_err(|_| error())?;
    Ok(Sample { name: name.to_owned(), labels, value })
}
