//! Chained 128-bit block hashes: the keys of the prefix cache.
//!
//! A cached block is named by a hash of its tokens chained to the hash of the block before it, so
//! one hash names a whole prefix. The chain starts from a [`Namespace`] (model, LoRA adapter and
//! cache salt), so caches of different models, adapters or tenants never share a key. Keys outlive
//! the process (the storage tier is keyed by them), so the encoding below is frozen: changing a
//! byte of it is a new format version with new domain tags, and `tests::known_vectors` pins it.
//!
//! Core types: [`BlockHash`], [`Namespace`], [`MultimodalItem`], [`BlockHasher`].
//!
//! Hashing one prompt ([`BlockHasher::hash_prompt`]):
//! 1. `h[-1]` is the namespace hash.
//! 2. For every full block `i` (only full blocks are cached), collect the content hashes of the
//!    multimodal items that overlap tokens `[i*B, (i+1)*B)` (an item spanning blocks is in each).
//! 3. `c[i] = XXH3-128(tokens of block i)`, the block's content hash, read straight from the
//!    token memory (little-endian `u32`s);
//! 4. `h[i] = XXH3-128(encode_block(h[i-1], token count, c[i], extras of block i))`.
//!
//! The encoding, all integers little-endian (XXH3-128, seed 0, is a frozen specification):
//! - namespace: `"kvshm/namespace/v1\0"`, then for each of model, LoRA and salt a `u8` presence
//!   flag (the model is always present), and when present a `u32` byte length and the bytes.
//! - block: `"kvshm/block/v2\0"`, the parent hash as 16 bytes, a `u32` token count, the content
//!   hash as 16 bytes, a `u32` extra count, each extra as 16 bytes.
//!
//! The distinct tags keep a namespace from ever colliding with a block by construction of the
//! input, and the explicit lengths keep field boundaries unambiguous. Hashing the tokens apart
//! (step 3) costs what hashing their bytes costs, without copying them into an encoding first;
//! chaining then hashes a few dozen bytes per block. (Format v1 hashed the tokens inside the
//! chained encoding, which meant a copy of every block; its keys are not v2's.)

use std::fmt;
use std::str::FromStr;

use serde::{Serialize, Serializer};
use xxhash_rust::xxh3::Xxh3Default;

/// Domain tag of namespace hashes (format version 1).
const NAMESPACE_TAG: &[u8] = b"kvshm/namespace/v1\0";
/// Domain tag of block hashes (format version 2).
const BLOCK_TAG: &[u8] = b"kvshm/block/v2\0";

/// The hash of one cached block together with everything before it.
///
/// Displayed and serialized as 32 lower-case hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BlockHash(pub u128);

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({:032x})", self.0)
    }
}

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl Serialize for BlockHash {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// A block hash written as anything but 1 to 32 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("block hash {text:?} is not 1 to 32 hex digits")]
pub struct ParseBlockHashError {
    pub text: String,
}

impl FromStr for BlockHash {
    type Err = ParseBlockHashError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let error = || ParseBlockHashError { text: text.to_owned() };
        if text.is_empty() || text.len() > 32 {
            return Err(error());
        }
        u128::from_str_radix(text, 16).map(BlockHash).map_err(|_| error())
    }
}

/// Who a cache belongs to: the hash every chain starts from.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Namespace(BlockHash);

impl Namespace {
    /// The namespace of a model, an optional LoRA adapter and an optional cache salt (tenant).
    /// An absent LoRA or salt differs from an empty one.
    pub fn new(model: &str, lora: Option<&str>, salt: Option<&[u8]>) -> Namespace {
        let mut hasher = Xxh3Default::new();
        hasher.update(NAMESPACE_TAG);
        update_field(&mut hasher, Some(model.as_bytes()));
        update_field(&mut hasher, lora.map(str::as_bytes));
        update_field(&mut hasher, salt);
        Namespace(BlockHash(hasher.digest128()))
    }

    /// The hash that block 0 chains to.
    pub fn root(&self) -> BlockHash {
        self.0
    }
}

fn update_field(hasher: &mut Xxh3Default, field: Option<&[u8]>) {
    match field {
        None => hasher.update(&[0]),
        Some(bytes) => {
            hasher.update(&[1]);
            hasher.update(&encoded_len(bytes.len()).to_le_bytes());
            hasher.update(bytes);
        }
    }
}

/// Lengths are encoded as u32; longer inputs cannot be named by this format.
///
/// # Panics
/// On a field longer than 4 GiB, which no model id, salt or block can be.
fn encoded_len(len: usize) -> u32 {
    u32::try_from(len).expect("a hashed field longer than u32::MAX is a programming error")
}

/// Hashes one block chained to `parent`: steps 3 and 4 of the module flow. `extras` are the
/// content hashes of the multimodal items overlapping the block, in prompt order.
pub fn chain_hash(parent: BlockHash, tokens: &[u32], extras: &[u128]) -> BlockHash {
    let content = content_hash(tokens);
    let mut head = [0u8; CHAIN_HEAD];
    head[..BLOCK_TAG.len()].copy_from_slice(BLOCK_TAG);
    head[CHAIN_PARENT..CHAIN_PARENT + 16].copy_from_slice(&parent.0.to_le_bytes());
    head[CHAIN_TOKENS..CHAIN_TOKENS + 4].copy_from_slice(&encoded_len(tokens.len()).to_le_bytes());
    head[CHAIN_CONTENT..CHAIN_CONTENT + 16].copy_from_slice(&content.to_le_bytes());
    head[CHAIN_EXTRAS..].copy_from_slice(&encoded_len(extras.len()).to_le_bytes());
    if extras.is_empty() {
        return BlockHash(xxhash_rust::xxh3::xxh3_128(&head));
    }
    if extras.len() <= INLINE_EXTRAS {
        // A block overlaps few multimodal items: its encoding fits on the stack.
        let mut encoding = [0u8; CHAIN_HEAD + 16 * INLINE_EXTRAS];
        let len = CHAIN_HEAD + 16 * extras.len();
        encoding[..CHAIN_HEAD].copy_from_slice(&head);
        for (slot, extra) in encoding[CHAIN_HEAD..len].chunks_exact_mut(16).zip(extras) {
            slot.copy_from_slice(&extra.to_le_bytes());
        }
        return BlockHash(xxhash_rust::xxh3::xxh3_128(&encoding[..len]));
    }
    let mut encoding = Vec::with_capacity(CHAIN_HEAD + 16 * extras.len());
    encoding.extend_from_slice(&head);
    for extra in extras {
        encoding.extend_from_slice(&extra.to_le_bytes());
    }
    BlockHash(xxhash_rust::xxh3::xxh3_128(&encoding))
}

/// Extra keys per block encoded on the stack; a block overlapping more items is encoded on the
/// heap (same bytes).
const INLINE_EXTRAS: usize = 8;

/// Where the fields of a block's chained encoding lie (module documentation, format v2).
const CHAIN_PARENT: usize = BLOCK_TAG.len();
const CHAIN_TOKENS: usize = CHAIN_PARENT + 16;
const CHAIN_CONTENT: usize = CHAIN_TOKENS + 4;
const CHAIN_EXTRAS: usize = CHAIN_CONTENT + 16;
/// The encoding up to and including the extra count: all of it for a block without extras.
const CHAIN_HEAD: usize = CHAIN_EXTRAS + 4;

/// Step 3 of the module flow: XXH3-128 of the tokens as little-endian `u32`s, which on a
/// little-endian machine is their memory as is.
#[cfg(target_endian = "little")]
fn content_hash(tokens: &[u32]) -> u128 {
    xxhash_rust::xxh3::xxh3_128(bytemuck::cast_slice(tokens))
}

/// Step 3 of the module flow: XXH3-128 of the tokens as little-endian `u32`s.
#[cfg(target_endian = "big")]
fn content_hash(tokens: &[u32]) -> u128 {
    let bytes: Vec<u8> = tokens.iter().flat_map(|token| token.to_le_bytes()).collect();
    xxhash_rust::xxh3::xxh3_128(&bytes)
}

/// A multimodal input (an image, an audio clip) occupying `len` placeholder tokens from token
/// `start`, identified by a hash of its content.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct MultimodalItem {
    pub start: usize,
    pub len: usize,
    pub content_hash: u128,
}

impl MultimodalItem {
    fn overlaps(&self, begin: usize, end: usize) -> bool {
        self.len > 0 && self.start < end && begin < self.start + self.len
    }
}

/// Hashes token sequences into the chained block hashes of one namespace.
#[derive(Clone, Debug)]
pub struct BlockHasher {
    namespace: Namespace,
    block_tokens: usize,
}

/// A hasher for blocks of zero tokens.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a block must hold at least one token")]
pub struct ZeroBlockTokens;

impl BlockHasher {
    /// A hasher for blocks of `block_tokens` tokens (at least 1).
    pub fn new(namespace: Namespace, block_tokens: usize) -> Result<BlockHasher, ZeroBlockTokens> {
        if block_tokens == 0 {
            return Err(ZeroBlockTokens);
        }
        Ok(BlockHasher { namespace, block_tokens })
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    pub fn namespace(&self) -> Namespace {
        self.namespace
    }

    /// The hashes of every full block of `tokens`.
    pub fn hash_prompt(&self, tokens: &[u32], items: &[MultimodalItem]) -> Vec<BlockHash> {
        let mut hashes = Vec::with_capacity(tokens.len() / self.block_tokens);
        self.extend(&mut hashes, tokens, items);
        hashes
    }

    /// Appends the hashes of the blocks of `tokens` that became full since `hashes` was last
    /// extended: `hashes` covers the first `hashes.len()` blocks of the same sequence. This is how
    /// generated tokens get their hashes without rehashing the prompt.
    pub fn extend(&self, hashes: &mut Vec<BlockHash>, tokens: &[u32], items: &[MultimodalItem]) {
        let mut extras = Vec::new();
        let full_blocks = tokens.len() / self.block_tokens;
        for index in hashes.len()..full_blocks {
            let begin = index * self.block_tokens;
            let end = begin + self.block_tokens;
            extras.clear();
            extras.extend(
                items.iter().filter(|item| item.overlaps(begin, end)).map(|item| item.content_hash),
            );
            let parent = hashes.last().copied().unwrap_or(self.namespace.root());
            hashes.push(chain_hash(parent, &tokens[begin..end], &extras));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hasher(block_tokens: usize) -> BlockHasher {
        BlockHasher::new(Namespace::new("llama-3-8b", None, None), block_tokens).unwrap()
    }

    #[test]
    fn xxh3_128_is_the_published_algorithm() {
        // The reference implementation's XXH3_128bits of the empty input, seed 0.
        assert_eq!(xxhash_rust::xxh3::xxh3_128(b""), 0x99aa06d3014798d86001c324468d497f);
    }

    #[test]
    fn known_vectors() {
        // Frozen: a change here breaks every stored key. See the module documentation.
        let namespace = Namespace::new("llama-3-8b", None, None);
        let tokens: Vec<u32> = (0..8).collect();
        let hashes = BlockHasher::new(namespace, 4).unwrap().hash_prompt(&tokens, &[]);
        let salted = Namespace::new("llama-3-8b", Some("adapter-a"), Some(b"tenant-1"));
        let item = MultimodalItem { start: 2, len: 4, content_hash: 0xfeed };
        let with_image = BlockHasher::new(namespace, 4).unwrap().hash_prompt(&tokens, &[item]);
        let actual = [namespace.root(), hashes[0], hashes[1], salted.root(), with_image[0]]
            .map(|hash| hash.to_string());
        let expected = [
            "62df333b2e126563e930d1345f6d7f80",
            "89ad8f2b3272b04c9222c390eb3f2718",
            "40fa9ec68a7c65a65d9e06f34df05859",
            "07e2ebad019b3b1e18bfdc8943850b57",
            "cdda6238054d803a46e677cabf7387a4",
        ];
        assert_eq!(actual, expected);
    }

    #[test]
    fn the_encoding_is_the_documented_byte_layout() {
        let mut namespace = b"kvshm/namespace/v1\0".to_vec();
        namespace.extend([1, 3, 0, 0, 0]);
        namespace.extend(b"abc");
        namespace.extend([0, 1, 0, 0, 0, 0]);
        let root = xxhash_rust::xxh3::xxh3_128(&namespace);
        assert_eq!(Namespace::new("abc", None, Some(b"")).root(), BlockHash(root));

        let content = xxhash_rust::xxh3::xxh3_128(&[7, 0, 0, 0, 0x04, 0x03, 0x02, 0x01]);
        let mut block = b"kvshm/block/v2\0".to_vec();
        block.extend(root.to_le_bytes());
        block.extend([2, 0, 0, 0]);
        block.extend(content.to_le_bytes());
        block.extend([1, 0, 0, 0]);
        block.extend(9u128.to_le_bytes());
        let expected = BlockHash(xxhash_rust::xxh3::xxh3_128(&block));
        assert_eq!(chain_hash(BlockHash(root), &[7, 0x0102_0304], &[9]), expected);

        // Without extras the encoding ends at the extra count.
        block.truncate(block.len() - 20);
        block.extend([0, 0, 0, 0]);
        let expected = BlockHash(xxhash_rust::xxh3::xxh3_128(&block));
        assert_eq!(chain_hash(BlockHash(root), &[7, 0x0102_0304], &[]), expected);

        // Any number of extras, on either side of the stack encoding's capacity, is the same
        // layout.
        for count in [INLINE_EXTRAS - 1, INLINE_EXTRAS, INLINE_EXTRAS + 1, 3 * INLINE_EXTRAS] {
            let extras: Vec<u128> = (0..count as u128).map(|i| i * 0x0101 + 5).collect();
            block.truncate(block.len() - 4);
            block.extend(u32::try_from(count).unwrap().to_le_bytes());
            extras.iter().for_each(|extra| block.extend(extra.to_le_bytes()));
            let expected = BlockHash(xxhash_rust::xxh3::xxh3_128(&block));
            assert_eq!(chain_hash(BlockHash(root), &[7, 0x0102_0304], &extras), expected);
            block.truncate(block.len() - 16 * count);
        }
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        let tokens: Vec<u32> = (0..11).collect();
        assert_eq!(hasher(4).hash_prompt(&tokens, &[]).len(), 2);
    }

    #[test]
    fn a_block_hash_names_its_whole_prefix() {
        let a: Vec<u32> = vec![1, 2, 3, 4, 5, 6, 7, 8];
        let b: Vec<u32> = vec![9, 2, 3, 4, 5, 6, 7, 8];
        let (ha, hb) = (hasher(4).hash_prompt(&a, &[]), hasher(4).hash_prompt(&b, &[]));
        assert_ne!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1], "same second block, different first block");
    }

    #[test]
    fn extending_matches_hashing_the_whole_sequence() {
        let tokens: Vec<u32> = (0..40).map(|t| t * 7 % 13).collect();
        let mut hashes = hasher(4).hash_prompt(&tokens[..10], &[]);
        hasher(4).extend(&mut hashes, &tokens, &[]);
        assert_eq!(hashes, hasher(4).hash_prompt(&tokens, &[]));
    }

    #[test]
    fn namespaces_isolate_models_adapters_and_salts() {
        let roots = [
            Namespace::new("m", None, None),
            Namespace::new("n", None, None),
            Namespace::new("m", Some("lora"), None),
            Namespace::new("m", None, Some(b"lora")),
            Namespace::new("m", Some(""), None),
            Namespace::new("m", None, Some(b"")),
        ]
        .map(|namespace| namespace.root());
        for (i, a) in roots.iter().enumerate() {
            for b in &roots[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn multimodal_items_change_every_block_they_overlap() {
        let tokens = vec![0u32; 12];
        let image = |hash| MultimodalItem { start: 3, len: 3, content_hash: hash };
        let plain = hasher(4).hash_prompt(&tokens, &[]);
        let cat = hasher(4).hash_prompt(&tokens, &[image(1)]);
        let dog = hasher(4).hash_prompt(&tokens, &[image(2)]);
        assert_ne!(plain[0], cat[0]);
        assert_ne!(cat[0], dog[0]);
        assert_ne!(cat[1], dog[1], "the item spans blocks 0 and 1");
        let only_second = MultimodalItem { start: 4, len: 4, content_hash: 1 };
        assert_eq!(plain[0], hasher(4).hash_prompt(&tokens, &[only_second])[0]);
    }

    #[test]
    fn a_block_of_zero_tokens_is_a_typed_error() {
        let namespace = Namespace::new("m", None, None);
        assert_eq!(BlockHasher::new(namespace, 0).unwrap_err(), ZeroBlockTokens);
    }

    #[test]
    fn block_hashes_round_trip_through_text() {
        let hash = BlockHash(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        assert_eq!(hash.to_string().parse::<BlockHash>(), Ok(hash));
        assert!("xyz".parse::<BlockHash>().is_err());
        assert_eq!(serde_json::to_string(&hash).unwrap(), format!("\"{hash}\""));
    }
}
