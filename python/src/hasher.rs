//! `BlockHasher`: token ids to chained block hashes of one namespace, as
//! [`kvshm::hash::BlockHasher`] computes them; multimodal items cross as `(start, len, hash)`.

use kvshm::hash::{BlockHasher as RustBlockHasher, MultimodalItem, Namespace};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::buffers::{read_hashes, read_u32s, BlockHashes};
use crate::errors::IntoPyResult;

/// Hashes token ids into chained block hashes of one namespace (model, LoRA, salt).
#[pyclass(frozen, module = "kvshm")]
pub struct BlockHasher {
    inner: RustBlockHasher,
}

fn read_items(items: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<MultimodalItem>> {
    let Some(items) = items else { return Ok(Vec::new()) };
    items
        .try_iter()?
        .map(|item| {
            let (start, len, content_hash): (usize, usize, u128) = item?.extract()?;
            Ok(MultimodalItem { start, len, content_hash })
        })
        .collect()
}

#[pymethods]
impl BlockHasher {
    #[new]
    #[pyo3(signature = (block_tokens, model="", lora=None, salt=None))]
    fn new(
        block_tokens: usize,
        model: &str,
        lora: Option<&str>,
        salt: Option<&[u8]>,
    ) -> PyResult<BlockHasher> {
        let namespace = Namespace::new(model, lora, salt);
        Ok(BlockHasher { inner: RustBlockHasher::new(namespace, block_tokens).py_err()? })
    }

    #[getter]
    fn block_tokens(&self) -> usize {
        self.inner.block_tokens()
    }

    /// The hash block 0 chains to.
    #[getter]
    fn namespace_root(&self) -> u128 {
        self.inner.namespace().root().0
    }

    /// The hashes of every full block of `tokens`; `mm_items` are `(start, length,
    /// content_hash)` of multimodal inputs.
    #[pyo3(signature = (tokens, mm_items=None))]
    fn hash_prompt(
        &self,
        tokens: &Bound<'_, PyAny>,
        mm_items: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<BlockHashes> {
        let tokens = read_u32s(tokens)?;
        let items = read_items(mm_items)?;
        Ok(BlockHashes::new(self.inner.hash_prompt(&tokens, &items)))
    }

    /// `hashes` extended with the blocks of `tokens` (the whole sequence so far) that became
    /// full since: how generated tokens get their hashes without rehashing the prompt.
    #[pyo3(signature = (hashes, tokens, mm_items=None))]
    fn extend(
        &self,
        hashes: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        mm_items: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<BlockHashes> {
        let mut hashes = read_hashes(hashes)?;
        let tokens = read_u32s(tokens)?;
        if hashes.len() > tokens.len() / self.inner.block_tokens() {
            return Err(PyValueError::new_err(format!(
                "{} hashes but only {} full blocks of tokens",
                hashes.len(),
                tokens.len() / self.inner.block_tokens()
            )));
        }
        self.inner.extend(&mut hashes, &tokens, &read_items(mm_items)?);
        Ok(BlockHashes::new(hashes))
    }
}
