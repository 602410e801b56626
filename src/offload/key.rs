//! Engine-supplied keys: opaque byte strings of up to [`MAX_KEY_BYTES`], held inline.
//!
//! An engine that hashes its blocks itself (vLLM's offloading keys: a 16- or 32-byte block hash
//! and a 4-byte KV-cache group index) hands kvshm its keys as bytes. [`OffloadKey`] keeps them
//! inline (no allocation per key) with their XXH3-64, and compares them whole, so two keys are
//! the same entry only when every byte agrees: no collision is possible, whatever the hash says.
//!
//! A key may end in a chain tag of a fixed number of bytes ([`KeyLayout::tag_bytes`]): keys of
//! one request with the same tag form one prefix chain (vLLM: one chain per KV-cache group).

use std::fmt;
use std::hash::{BuildHasherDefault, Hash, Hasher};

/// The longest key kvshm accepts.
pub const MAX_KEY_BYTES: usize = 64;

/// A key longer than [`MAX_KEY_BYTES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a key of {len} bytes is longer than the {MAX_KEY_BYTES} kvshm accepts")]
pub struct KeyTooLong {
    pub len: usize,
}

/// One engine key, inline, with the XXH3 of its bytes computed once.
#[derive(Clone, Copy)]
pub struct OffloadKey {
    hash: u64,
    len: u8,
    bytes: [u8; MAX_KEY_BYTES],
}

impl OffloadKey {
    pub fn new(bytes: &[u8]) -> Result<OffloadKey, KeyTooLong> {
        if bytes.len() > MAX_KEY_BYTES {
            return Err(KeyTooLong { len: bytes.len() });
        }
        let mut key = OffloadKey {
            hash: xxhash_rust::xxh3::xxh3_64(bytes),
            len: bytes.len() as u8,
            bytes: [0; MAX_KEY_BYTES],
        };
        key.bytes[..bytes.len()].copy_from_slice(bytes);
        Ok(key)
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    /// A key with a chosen hash, so that tests can make keys collide.
    #[cfg(test)]
    pub(crate) fn with_hash_for_tests(bytes: &[u8], hash: u64) -> OffloadKey {
        OffloadKey { hash, ..OffloadKey::new(bytes).expect("a short test key") }
    }

    /// XXH3-64 of the bytes. Equal keys have equal hashes; the converse needs the bytes.
    pub fn hash64(&self) -> u64 {
        self.hash
    }

    /// The chain this key belongs to: its last `tag_bytes` bytes (all of it when shorter).
    pub fn chain_tag(&self, tag_bytes: usize) -> &[u8] {
        let bytes = self.as_bytes();
        &bytes[bytes.len().saturating_sub(tag_bytes)..]
    }
}

impl PartialEq for OffloadKey {
    fn eq(&self, other: &OffloadKey) -> bool {
        self.hash == other.hash && self.as_bytes() == other.as_bytes()
    }
}

impl Eq for OffloadKey {}

impl Hash for OffloadKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The XXH3 of the bytes; the table's hasher passes it through.
        state.write_u64(self.hash);
    }
}

impl fmt::Debug for OffloadKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OffloadKey(")?;
        for byte in self.as_bytes() {
            write!(f, "{byte:02x}")?;
        }
        write!(f, ")")
    }
}

/// Where a key's chain tag lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct KeyLayout {
    /// Bytes at the end of every key that name its chain (vLLM: 4, the group index); 0 puts all
    /// keys of a request in one chain.
    pub tag_bytes: usize,
}

/// A hasher for values that hash themselves into one well-mixed `u64` (keys): it passes that
/// word through; bytes (request names) go through XXH3.
#[derive(Default, Clone, Copy)]
pub struct PassThroughHasher {
    state: u64,
}

impl Hasher for PassThroughHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.state = xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.state);
    }

    fn write_u8(&mut self, byte: u8) {
        // The terminator `str` hashing appends.
        self.state = (self.state ^ u64::from(byte)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn write_u64(&mut self, value: u64) {
        self.state ^= value;
    }

    fn finish(&self) -> u64 {
        self.state
    }
}

pub type BuildPassThrough = BuildHasherDefault<PassThroughHasher>;

/// A request's name as the engine gives it (vLLM: a string).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestName(Box<str>);

impl RequestName {
    pub fn new(name: &str) -> RequestName {
        RequestName(name.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Hash for RequestName {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // As `str` hashes, so that a table of names can be searched by `&str`.
        self.0.hash(state);
    }
}

impl std::borrow::Borrow<str> for RequestName {
    fn borrow(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn keys_up_to_64_bytes_are_kept_whole_and_longer_ones_refused() {
        let long = [7u8; 65];
        assert_eq!(OffloadKey::new(&long).unwrap_err(), KeyTooLong { len: 65 });
        let key = OffloadKey::new(&long[..64]).unwrap();
        assert_eq!(key.as_bytes(), &long[..64]);
        assert_eq!(OffloadKey::new(b"").unwrap().as_bytes(), b"");
    }

    #[test]
    fn keys_that_differ_in_any_byte_or_length_are_different_entries() {
        let mut table: HashMap<OffloadKey, u32, BuildPassThrough> = HashMap::default();
        let base = [0xabu8; 36];
        for index in 0..36 {
            let mut bytes = base;
            bytes[index] ^= 1;
            table.insert(OffloadKey::new(&bytes).unwrap(), index as u32);
        }
        table.insert(OffloadKey::new(&base).unwrap(), 100);
        table.insert(OffloadKey::new(&base[..35]).unwrap(), 101);
        // A zero byte at the end is not padding: "ab" and "ab\0" are two keys.
        table.insert(OffloadKey::new(b"ab").unwrap(), 102);
        table.insert(OffloadKey::new(b"ab\0").unwrap(), 103);
        assert_eq!(table.len(), 40);
        assert_eq!(table[&OffloadKey::new(&base).unwrap()], 100);
        assert_eq!(table[&OffloadKey::new(b"ab\0").unwrap()], 103);
    }

    #[test]
    fn the_chain_tag_is_the_keys_last_bytes() {
        let mut bytes = [1u8; 36];
        bytes[32..].copy_from_slice(&3u32.to_be_bytes());
        let key = OffloadKey::new(&bytes).unwrap();
        assert_eq!(key.chain_tag(4), &[0, 0, 0, 3]);
        assert_eq!(key.chain_tag(0), b"");
        assert_eq!(OffloadKey::new(b"ab").unwrap().chain_tag(4), b"ab");
    }
}
