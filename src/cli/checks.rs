//! Checks of the numbers a person types on the `kvshm` command line, shared by every subcommand.
//!
//! clap parses each option into its Rust type; these checks then refuse what the type allows but
//! the program cannot do: zero where at least one is needed, seconds beyond what a `Duration`
//! holds, sizes whose products overflow, and sizes the machine cannot hold (more bytes than
//! `/dev/shm` has free, or than the memory a process may still take). Each subcommand runs them
//! before any work starts, and each error names the option and the value, so nothing typed on a
//! command line makes kvshm panic, abort or wrap silently.
//!
//! Flow of one subcommand: 1. clap parses; 2. `run` calls these checks on every number;
//! 3. only then does it allocate, create segments or spawn processes.

use std::fmt::Display;
use std::ops::RangeInclusive;
use std::time::Duration;

use anyhow::{bail, ensure};

/// One mebibyte.
pub const MIB: u64 = 1 << 20;

/// `value` of `option`, refused unless it lies in `range`.
pub fn within<T: PartialOrd + Display + Copy>(
    value: T,
    range: RangeInclusive<T>,
    option: &str,
) -> anyhow::Result<T> {
    ensure!(
        range.contains(&value),
        "{option} {value} is out of range: it must be between {} and {}",
        range.start(),
        range.end()
    );
    Ok(value)
}

/// `value` of `option`, refused if below `min`.
pub fn at_least<T: PartialOrd + Display + Copy>(
    value: T,
    min: T,
    option: &str,
) -> anyhow::Result<T> {
    ensure!(value >= min, "{option} {value} is too small: it must be at least {min}");
    Ok(value)
}

/// A number of seconds (zero allowed) that a `Duration` can hold.
pub fn seconds(value: f64, option: &str) -> anyhow::Result<Duration> {
    match Duration::try_from_secs_f64(value) {
        Ok(duration) => Ok(duration),
        Err(_) => bail!(
            "{option} {} is not a usable number of seconds: it must be finite, between 0 and \
             {:.1e}",
            readable(value),
            Duration::MAX.as_secs_f64()
        ),
    }
}

/// A number of seconds above zero that a `Duration` can hold.
pub fn positive_seconds(value: f64, option: &str) -> anyhow::Result<Duration> {
    let duration = seconds(value, option)?;
    ensure!(!duration.is_zero(), "{option} {} must be more than 0 seconds", readable(value));
    Ok(duration)
}

/// A float as a person would have typed it: `1e300`, not three hundred digits.
fn readable(value: f64) -> String {
    let magnitude = value.abs();
    if magnitude != 0.0 && !(1e-3..1e9).contains(&magnitude) {
        format!("{value:e}")
    } else {
        format!("{value}")
    }
}

/// `mib` MiB in bytes, refused if that overflows.
pub fn mib_to_bytes(mib: u64, option: &str) -> anyhow::Result<u64> {
    match mib.checked_mul(MIB) {
        Some(bytes) => Ok(bytes),
        None => bail!("{option} {mib} is too large: {mib} MiB is more bytes than a u64 counts"),
    }
}

/// Refuses `bytes` of `/dev/shm` for `what` if `/dev/shm` does not have them free.
pub fn fits_in_dev_shm(bytes: u128, what: impl Display) -> anyhow::Result<()> {
    let stat = match nix::sys::statvfs::statvfs(kvshm_ipc::listing::SHM_DIR) {
        Ok(stat) => stat,
        // Nothing to compare with: creating the objects will say.
        Err(_) => return Ok(()),
    };
    let free = u128::from(stat.blocks_available()) * u128::from(stat.fragment_size());
    ensure!(
        bytes <= free,
        "{what} need {} of shared memory, and {} has {} free",
        human_bytes(bytes),
        kvshm_ipc::listing::SHM_DIR,
        human_bytes(free)
    );
    Ok(())
}

/// Refuses `bytes` of heap for `what` if this process cannot have them: more than the memory
/// the machine has available (`MemAvailable`), or than the address-space limit (`RLIMIT_AS`).
pub fn fits_in_memory(bytes: u128, what: impl Display) -> anyhow::Result<()> {
    let Some(available) = available_memory() else {
        return Ok(());
    };
    ensure!(
        bytes <= u128::from(available),
        "{what} need {} of memory, and this process can have at most {}",
        human_bytes(bytes),
        human_bytes(u128::from(available))
    );
    Ok(())
}

/// The smaller of the machine's available memory and our address-space limit, if known.
fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let available = meminfo.as_deref().and_then(|text| {
        let line = text.lines().find(|line| line.starts_with("MemAvailable:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        kib.checked_mul(1024)
    });
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into the struct we own and pass by pointer, and reads
    // nothing else.
    let known = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) } == 0;
    let limit = (known && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur);
    match (available, limit) {
        (Some(available), Some(limit)) => Some(available.min(limit)),
        (available, limit) => available.or(limit),
    }
}

/// `bytes` as a person reads it: `1.5 GiB`.
pub fn human_bytes(bytes: u128) -> String {
    const UNITS: [&str; 7] = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} bytes")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_name_the_option_and_the_bounds() {
        assert_eq!(within(3, 1..=8, "--tp").unwrap(), 3);
        let error = within(0u32, 1..=8, "--tp").unwrap_err().to_string();
        assert!(error.contains("--tp 0") && error.contains("between 1 and 8"), "{error}");
        assert!(at_least(0usize, 1, "--samples").unwrap_err().to_string().contains("--samples 0"));
    }

    #[test]
    fn seconds_a_duration_cannot_hold_are_refused() {
        assert_eq!(seconds(1.5, "--x").unwrap(), Duration::from_millis(1500));
        assert_eq!(seconds(0.0, "--x").unwrap(), Duration::ZERO);
        for bad in [1e300, f64::NAN, -1.0, f64::INFINITY] {
            assert!(seconds(bad, "--x").unwrap_err().to_string().contains("--x"), "{bad}");
        }
        assert!(positive_seconds(0.0, "--x").is_err());
    }

    #[test]
    fn mebibytes_that_overflow_are_refused() {
        assert_eq!(mib_to_bytes(2, "--tier-mib").unwrap(), 2 << 20);
        assert!(mib_to_bytes(u64::MAX, "--tier-mib")
            .unwrap_err()
            .to_string()
            .contains("--tier-mib"));
    }

    #[test]
    fn more_than_the_machine_has_is_refused() {
        assert!(fits_in_memory(u128::from(u64::MAX) * 4, "the pools").is_err());
        assert!(fits_in_dev_shm(u128::from(u64::MAX) * 4, "the arenas").is_err());
        assert!(fits_in_memory(1024, "a little").is_ok());
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
        assert_eq!(human_bytes(12), "12 bytes");
    }
}
