//! The seeded xorshift generator of the crate's randomized unit tests: deterministic from its
//! seed, so a failing case replays, and no crate needed.

/// The next number of the xorshift sequence in `state` (never 0 from a non-zero state).
pub(crate) fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// A deterministic picker for seed `seed`: each call a number below its argument.
pub(crate) fn picker(seed: u64) -> impl FnMut(usize) -> usize {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move |n: usize| (xorshift(&mut state) % n as u64) as usize
}
