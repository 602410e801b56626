//! Arrays across the boundary: block tables and hashes go out as read-only buffer objects (numpy
//! wraps them without a copy: `numpy.asarray(table)`), and token ids, block ids and hashes come
//! in from any buffer (numpy arrays, `array.array`, `bytes`) or, slower, a sequence of ints.
//!
//! Core types: [`U32Array`] (block tables, chunk ids), [`BlockHashes`] (chained block hashes,
//! 16 little-endian bytes each).

use std::ffi::{c_int, c_void, CStr};

use kvshm::hash::BlockHash;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyBufferError, PyIndexError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyIterator, PyList};

/// A read-only array of u32 (buffer format `I`): a block table, chunk ids.
#[pyclass(frozen, module = "kvshm")]
pub struct U32Array {
    values: Box<[u32]>,
    /// Buffer shape and strides, kept here so that views can point at them while they live.
    shape: [isize; 1],
    strides: [isize; 1],
}

impl U32Array {
    pub fn new(values: impl Into<Box<[u32]>>) -> U32Array {
        let values = values.into();
        let len = values.len() as isize;
        U32Array { values, shape: [len], strides: [size_of::<u32>() as isize] }
    }

    pub fn values(&self) -> &[u32] {
        &self.values
    }
}

#[pymethods]
impl U32Array {
    /// An array of `values` (a buffer of integers or a sequence of ints, each a u32).
    #[new]
    fn py_new(values: &Bound<'_, PyAny>) -> PyResult<U32Array> {
        Ok(U32Array::new(read_u32s(values)?))
    }

    /// Pickles as `U32Array([values])`: engines send chunk lists to other processes.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> (Bound<'py, pyo3::types::PyType>, (Vec<u32>,)) {
        (slf.get_type(), (slf.get().values.to_vec(),))
    }

    fn __len__(&self) -> usize {
        self.values.len()
    }

    fn __getitem__(&self, index: isize) -> PyResult<u32> {
        Ok(self.values[sequence_index(index, self.values.len())?])
    }

    fn tolist(&self) -> Vec<u32> {
        self.values.to_vec()
    }

    /// Iterates over the values (a snapshot: the array is frozen anyway).
    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyIterator>> {
        PyList::new(py, self.values.iter())?.try_iter()
    }

    fn __repr__(&self) -> String {
        format!("U32Array({:?})", self.values)
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        read_u32s(other).is_ok_and(|values| values == *self.values)
    }

    /// # Safety
    /// Called by Python's buffer protocol with a valid `view`.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let this = slf.get();
        let (data, shape, strides) = (
            this.values.as_ptr().cast::<c_void>(),
            this.shape.as_ptr().cast_mut(),
            this.strides.as_ptr().cast_mut(),
        );
        let len = this.values.len() * size_of::<u32>();
        // SAFETY: `view` comes from Python's buffer protocol; the data, shape and strides live
        // in a frozen object (never mutated, never moved) that the view keeps alive through
        // `obj`.
        unsafe {
            fill_readonly_view(view, flags, data, len, 4, c"I", shape, strides, slf.into_any())
        }
    }
}

/// Chained block hashes (`BlockHasher` output), exposed as 16 little-endian bytes per hash.
#[pyclass(frozen, module = "kvshm")]
pub struct BlockHashes {
    hashes: Vec<BlockHash>,
    bytes: Box<[u8]>,
    shape: [isize; 1],
    strides: [isize; 1],
}

impl BlockHashes {
    pub fn new(hashes: Vec<BlockHash>) -> BlockHashes {
        let bytes: Box<[u8]> = hashes.iter().flat_map(|hash| hash.0.to_le_bytes()).collect();
        let len = bytes.len() as isize;
        BlockHashes { hashes, bytes, shape: [len], strides: [1] }
    }

    pub fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }
}

#[pymethods]
impl BlockHashes {
    fn __len__(&self) -> usize {
        self.hashes.len()
    }

    /// The hash of block `index` as an int.
    fn __getitem__(&self, index: isize) -> PyResult<u128> {
        Ok(self.hashes[sequence_index(index, self.hashes.len())?].0)
    }

    fn tolist(&self) -> Vec<u128> {
        self.hashes.iter().map(|hash| hash.0).collect()
    }

    /// Iterates over the hashes as ints.
    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyIterator>> {
        PyList::new(py, self.hashes.iter().map(|hash| hash.0))?.try_iter()
    }

    /// The first `count` hashes.
    fn prefix(&self, count: usize) -> BlockHashes {
        BlockHashes::new(self.hashes[..count.min(self.hashes.len())].to_vec())
    }

    fn __repr__(&self) -> String {
        let shown: Vec<String> = self.hashes.iter().take(4).map(|hash| hash.to_string()).collect();
        let more = if self.hashes.len() > 4 { ", ..." } else { "" };
        format!("BlockHashes([{}{more}], len={})", shown.join(", "), self.hashes.len())
    }

    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.bytes)
    }

    /// # Safety
    /// Called by Python's buffer protocol with a valid `view`.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let this = slf.get();
        let (data, shape, strides) = (
            this.bytes.as_ptr().cast::<c_void>(),
            this.shape.as_ptr().cast_mut(),
            this.strides.as_ptr().cast_mut(),
        );
        let len = this.bytes.len();
        // SAFETY: as for U32Array: the frozen object holding the bytes, shape and strides is
        // kept alive by the view.
        unsafe {
            fill_readonly_view(view, flags, data, len, 1, c"B", shape, strides, slf.into_any())
        }
    }
}

/// Fills a one-dimensional read-only buffer view.
///
/// # Safety
/// `view` is a valid `Py_buffer` handed over by Python; `data` (`len` bytes), `shape` and
/// `strides` stay valid and unchanged while `owner` lives.
#[allow(clippy::too_many_arguments)]
unsafe fn fill_readonly_view(
    view: *mut ffi::Py_buffer,
    flags: c_int,
    data: *const c_void,
    len: usize,
    itemsize: isize,
    format: &'static CStr,
    shape: *mut isize,
    strides: *mut isize,
    owner: Bound<'_, PyAny>,
) -> PyResult<()> {
    if view.is_null() {
        return Err(PyBufferError::new_err("no view to fill"));
    }
    if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
        return Err(PyBufferError::new_err("kvshm arrays are read-only"));
    }
    // SAFETY: the caller guarantees `view` is valid to write; every pointer stored stays valid
    // while `owner`, whose reference the view now holds, lives.
    unsafe {
        (*view).obj = owner.into_ptr();
        (*view).buf = data.cast_mut();
        (*view).len = len as isize;
        (*view).readonly = 1;
        (*view).itemsize = itemsize;
        (*view).format = if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT {
            format.as_ptr().cast_mut()
        } else {
            std::ptr::null_mut()
        };
        (*view).ndim = 1;
        (*view).shape =
            if flags & ffi::PyBUF_ND == ffi::PyBUF_ND { shape } else { std::ptr::null_mut() };
        (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
            strides
        } else {
            std::ptr::null_mut()
        };
        (*view).suboffsets = std::ptr::null_mut();
        (*view).internal = std::ptr::null_mut();
    }
    Ok(())
}

/// Integers from a buffer of any integer type or a sequence of ints, as i128 for range checks.
/// Position `index` of a sequence of `len` items, counted from the end when negative, as
/// Python's sequences do; an `IndexError` past either end.
fn sequence_index(index: isize, len: usize) -> PyResult<usize> {
    let position = if index < 0 { index.checked_add_unsigned(len) } else { Some(index) };
    match position.and_then(|position| usize::try_from(position).ok()) {
        Some(position) if position < len => Ok(position),
        _ => Err(PyIndexError::new_err(format!("index {index} out of range 0..{len}"))),
    }
}

fn read_integers(object: &Bound<'_, PyAny>) -> PyResult<Vec<i128>> {
    let py = object.py();
    macro_rules! try_buffer {
        ($($kind:ty),*) => {$(
            if let Ok(buffer) = PyBuffer::<$kind>::get(object) {
                return Ok(buffer.to_vec(py)?.into_iter().map(i128::from).collect());
            }
        )*};
    }
    try_buffer!(u32, i32, i64, u64, u16, i16, u8, i8);
    if object.is_instance_of::<PyBytes>() || object.is_instance_of::<pyo3::types::PyString>() {
        return Err(PyTypeError::new_err("expected integers, got bytes or str"));
    }
    if let Ok(list) = object.cast::<PyList>() {
        return list.iter().map(|item| item.extract::<i128>()).collect();
    }
    object
        .try_iter()
        .map_err(|_| PyTypeError::new_err("expected a buffer or a sequence of integers"))?
        .map(|item| item?.extract::<i128>())
        .collect()
}

/// i64 values (block ids, group sizes) from a buffer or a sequence of ints.
pub fn read_i64s(object: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    read_integers(object)?
        .into_iter()
        .map(|value| {
            i64::try_from(value)
                .map_err(|_| PyValueError::new_err(format!("{value} is not an i64")))
        })
        .collect()
}

/// u32 values (token ids, block ids) from a buffer or a sequence of ints.
pub fn read_u32s(object: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    read_integers(object)?
        .into_iter()
        .map(|value| {
            u32::try_from(value)
                .map_err(|_| PyValueError::new_err(format!("{value} is not a u32 (0..2**32)")))
        })
        .collect()
}

/// Block hashes from a `BlockHashes`, a bytes-like buffer of 16 little-endian bytes per hash,
/// or a sequence of ints below 2**128.
pub fn read_hashes(object: &Bound<'_, PyAny>) -> PyResult<Vec<BlockHash>> {
    if let Ok(hashes) = object.cast::<BlockHashes>() {
        return Ok(hashes.get().hashes.clone());
    }
    let py = object.py();
    if let Ok(buffer) = PyBuffer::<u8>::get(object) {
        let bytes = buffer.to_vec(py)?;
        if bytes.len() % 16 != 0 {
            return Err(PyValueError::new_err(format!(
                "{} bytes of hashes is not a whole number of 16-byte hashes",
                bytes.len()
            )));
        }
        return Ok(bytes
            .chunks_exact(16)
            .map(|chunk| BlockHash(u128::from_le_bytes(chunk.try_into().expect("16 bytes"))))
            .collect());
    }
    let iterator = object
        .try_iter()
        .map_err(|_| PyTypeError::new_err("expected BlockHashes, bytes or a sequence of ints"))?;
    iterator
        .map(|item| {
            let item = item?;
            item.extract::<u128>().map(BlockHash).map_err(|_| {
                PyValueError::new_err(format!("{item} is not a block hash (an int in 0..2**128)"))
            })
        })
        .collect()
}
