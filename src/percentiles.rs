//! The 50th and 99th percentiles of a sample, the one summary every report of kvshm prints.
//!
//! [`Percentiles::of`] sorts the sample in place and picks by the nearest-rank method: the
//! p-th percentile of `n` sorted values is value number `ceil(p * n)` (counting from 1).
//! [`Percentiles::of_micros`] does the same for durations, in microseconds.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The 50th and 99th percentiles of a sample.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p99: f64,
}

impl Percentiles {
    /// Percentiles of `samples` (sorted in place), by the nearest rank; zeros when empty.
    pub fn of(samples: &mut [f64]) -> Percentiles {
        if samples.is_empty() {
            return Percentiles::default();
        }
        samples.sort_unstable_by(f64::total_cmp);
        let rank = |p: f64| {
            samples[((p * samples.len() as f64).ceil() as usize).clamp(1, samples.len()) - 1]
        };
        Percentiles { p50: rank(0.50), p99: rank(0.99) }
    }

    /// Percentiles of `samples` in microseconds, by the nearest rank; zeros when empty.
    pub fn of_micros(samples: &[Duration]) -> Percentiles {
        let mut micros: Vec<f64> =
            samples.iter().map(|sample| sample.as_secs_f64() * 1e6).collect();
        Percentiles::of(&mut micros)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let mut samples: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(Percentiles::of(&mut samples), Percentiles { p50: 50.0, p99: 99.0 });
        assert_eq!(Percentiles::of(&mut []), Percentiles::default());
    }

    #[test]
    fn durations_are_summarised_in_microseconds() {
        let samples: Vec<Duration> = (1..=4).map(Duration::from_millis).collect();
        assert_eq!(Percentiles::of_micros(&samples), Percentiles { p50: 2000.0, p99: 4000.0 });
    }
}
