//! Counting per-block outcomes: what the workers add to the segment's storage counters and what
//! the benchmark and tests report.
//!
//! Core type: [`Tally`]. Flow: 1. a caller runs a batch on a back-end; 2. it adds the outcomes
//! with [`Tally::puts`], [`Tally::gets`], [`Tally::queries`] or [`Tally::forgets`]; 3. it reads the fields (the worker
//! adds them to `Counter::Storage*`).

use super::backend::{ContainsOutcome, Failure, GetMiss, GetOutcome, PutOutcome};

/// Counts of per-block outcomes (each failed block once).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Tally {
    pub stored: u64,
    pub store_failures: u64,
    pub load_hits: u64,
    pub load_misses: u64,
    pub corrupt: u64,
    pub queried: u64,
    pub query_hits: u64,
    /// Blocks FORGET commands named (forgotten, or kept by a shared tier).
    pub forgotten: u64,
    pub errors: u64,
    pub timeouts: u64,
    pub unavailable: u64,
    pub no_space: u64,
}

impl Tally {
    fn failure(&mut self, failure: &Failure) {
        match failure {
            Failure::NoSpace => self.no_space += 1,
            Failure::Timeout => self.timeouts += 1,
            Failure::Unavailable => self.unavailable += 1,
            Failure::Io(_) => self.errors += 1,
        }
    }

    pub fn puts(&mut self, outcomes: &[PutOutcome]) {
        for outcome in outcomes {
            match outcome {
                Ok(()) => self.stored += 1,
                Err(failure) => {
                    self.store_failures += 1;
                    self.failure(failure);
                }
            }
        }
    }

    pub fn gets(&mut self, outcomes: &[GetOutcome]) {
        for outcome in outcomes {
            match outcome {
                Ok(()) => self.load_hits += 1,
                Err(miss) => {
                    self.load_misses += 1;
                    match miss {
                        GetMiss::Absent => {}
                        GetMiss::Corrupt => self.corrupt += 1,
                        GetMiss::Failed(failure) => self.failure(failure),
                    }
                }
            }
        }
    }

    pub fn queries(&mut self, outcomes: &[ContainsOutcome]) {
        for outcome in outcomes {
            self.queried += 1;
            match outcome {
                Ok(present) => self.query_hits += u64::from(*present),
                Err(failure) => self.failure(failure),
            }
        }
    }

    pub fn forgets(&mut self, outcomes: &[PutOutcome]) {
        for outcome in outcomes {
            self.forgotten += 1;
            if let Err(failure) = outcome {
                self.failure(failure);
            }
        }
    }

    /// Blocks that failed because the tier did (any kind).
    pub fn failures(&self) -> u64 {
        self.errors + self.timeouts + self.unavailable + self.no_space
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_outcome_lands_in_its_counts() {
        let mut tally = Tally::default();
        tally.puts(&[Ok(()), Err(Failure::NoSpace), Err(Failure::Io("x".into()))]);
        tally.gets(&[
            Ok(()),
            Err(GetMiss::Absent),
            Err(GetMiss::Corrupt),
            Err(GetMiss::Failed(Failure::Timeout)),
        ]);
        tally.queries(&[Ok(true), Ok(false), Err(Failure::Unavailable)]);
        tally.forgets(&[Ok(()), Err(Failure::Io("y".into()))]);
        assert_eq!(
            tally,
            Tally {
                stored: 1,
                store_failures: 2,
                load_hits: 1,
                load_misses: 3,
                corrupt: 1,
                queried: 3,
                query_hits: 1,
                forgotten: 2,
                errors: 2,
                timeouts: 1,
                unavailable: 1,
                no_space: 1,
            }
        );
        assert_eq!(tally.failures(), 5);
    }
}
