//! [`TierIdentity`]: what makes the blocks of two engine instances interchangeable, the name a
//! shared tier is found by, and the check that refuses an instance whose blocks would not be.
//! The owner keeps it in the tier's control object ([`TierIdentity::encode`]); a client decodes it
//! there ([`TierIdentity::decode`], which trusts none of it) and compares it with its own.

use serde::Serialize;

use super::SharedTierError;

/// What a block's bytes mean: two instances may share a tier only when every field agrees. The
/// tier's name is derived from it ([`TierIdentity::tier_name`]), so instances of one model and
/// layout find the same tier; the tier keeps the whole identity and refuses an attach that
/// differs in any field (a digest collision never mixes blocks).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TierIdentity {
    /// The model, as the engine names it (a path or a hub id).
    pub model: String,
    /// The KV cache's element type (`float16`, `bfloat16`, `fp8_e4m3`, ...).
    pub kv_dtype: String,
    /// Tokens per engine block.
    pub block_tokens: u32,
    /// Bytes of one block on one rank, all layers.
    pub block_bytes: u64,
    /// Engine blocks per chunk of the tier.
    pub blocks_per_chunk: u32,
    /// The rest of the layout, as the engine spells it: the KV-cache groups' layers, the
    /// tensor, pipeline and context parallel sizes (never the engine id or the data-parallel
    /// index, which differ between instances that share).
    pub layout: String,
}

impl TierIdentity {
    /// XXH3-64 over every field, each length-prefixed ([`TierIdentity::encode`]).
    pub fn digest(&self) -> u64 {
        xxhash_rust::xxh3::xxh3_64(&self.encode())
    }

    /// Every field, texts prefixed by their length (u64, little-endian), then the numbers.
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::new();
        for text in [&self.model, &self.kv_dtype, &self.layout] {
            bytes.extend_from_slice(&(text.len() as u64).to_le_bytes());
            bytes.extend_from_slice(text.as_bytes());
        }
        bytes.extend_from_slice(&self.block_tokens.to_le_bytes());
        bytes.extend_from_slice(&self.block_bytes.to_le_bytes());
        bytes.extend_from_slice(&self.blocks_per_chunk.to_le_bytes());
        bytes
    }

    /// The identity [`TierIdentity::encode`] wrote, or `None` when `bytes` is not one (cut
    /// short, too long, or a text that is not UTF-8).
    pub fn decode(bytes: &[u8]) -> Option<TierIdentity> {
        let mut rest = bytes;
        let mut take = |len: usize| -> Option<&[u8]> {
            let (head, tail) = rest.split_at_checked(len)?;
            rest = tail;
            Some(head)
        };
        let mut text = || -> Option<String> {
            let len = u64::from_le_bytes(take(8)?.try_into().ok()?);
            String::from_utf8(take(usize::try_from(len).ok()?)?.to_vec()).ok()
        };
        let (model, kv_dtype, layout) = (text()?, text()?, text()?);
        let mut take = |len: usize| -> Option<&[u8]> {
            let (head, tail) = rest.split_at_checked(len)?;
            rest = tail;
            Some(head)
        };
        let block_tokens = u32::from_le_bytes(take(4)?.try_into().ok()?);
        let block_bytes = u64::from_le_bytes(take(8)?.try_into().ok()?);
        let blocks_per_chunk = u32::from_le_bytes(take(4)?.try_into().ok()?);
        rest.is_empty().then_some(TierIdentity {
            model,
            kv_dtype,
            block_tokens,
            block_bytes,
            blocks_per_chunk,
            layout,
        })
    }

    /// The tier's segment name: `kvshm-tier-<model>-<digest>`, the model's last path component
    /// cut to 24 characters of `[A-Za-z0-9_-]`.
    pub fn tier_name(&self) -> String {
        let model = self.model.trim_end_matches('/').rsplit('/').next().unwrap_or_default();
        let model: String = model
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c } else { '-' })
            .take(24)
            .collect();
        format!("kvshm-tier-{model}-{:012x}", self.digest() >> 16)
    }

    /// The storage namespace a tier of this identity keeps its storage tier in (DESIGN §12.8):
    /// named by the digest, so that tiers of other blocks never read each other's, whatever
    /// their names.
    pub fn storage_namespace(&self) -> String {
        format!("tier-{:016x}", self.digest())
    }

    /// Refuses `client` unless it names the same blocks as this tier, naming the first field
    /// that differs.
    pub fn check_attach(&self, client: &TierIdentity) -> Result<(), SharedTierError> {
        let fields: [(&'static str, String, String); 6] = [
            ("model", self.model.clone(), client.model.clone()),
            ("kv_dtype", self.kv_dtype.clone(), client.kv_dtype.clone()),
            ("block_tokens", self.block_tokens.to_string(), client.block_tokens.to_string()),
            ("block_bytes", self.block_bytes.to_string(), client.block_bytes.to_string()),
            (
                "blocks_per_chunk",
                self.blocks_per_chunk.to_string(),
                client.blocks_per_chunk.to_string(),
            ),
            ("layout", self.layout.clone(), client.layout.clone()),
        ];
        match fields.into_iter().find(|(_, tier, client)| tier != client) {
            None => Ok(()),
            Some((field, tier, client)) => Err(SharedTierError::Mismatch { field, tier, client }),
        }
    }
}
