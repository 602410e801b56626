//! [`CopyMethod`]: how the CUDA engine moves a layer's pieces, a `kvshm worker --cuda-copy`
//! option in every build (the engine itself is behind the `cuda` feature).

/// How the engine moves a layer's pieces (`super::cuda::engine`'s module flow).
///
/// On an H100 (`kvshm bench copy --backend cuda`, docs/BENCHMARKS.md) the kernel moves scattered
/// blocks 3 to 30 times faster than one call per piece, and long runs of large blocks within 10%
/// of it; the calls leave the GPU's threads to the engine's own kernels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CopyMethod {
    /// One driver call per piece: DMA by the copy engines, no GPU thread used.
    Calls,
    /// kvshm's copy kernel, one launch per group of layers: the GPU's threads move the rows.
    #[default]
    Kernel,
}

impl CopyMethod {
    pub const ALL: [CopyMethod; 2] = [CopyMethod::Kernel, CopyMethod::Calls];

    pub fn name(self) -> &'static str {
        match self {
            CopyMethod::Calls => "calls",
            CopyMethod::Kernel => "kernel",
        }
    }
}

impl std::fmt::Display for CopyMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CopyMethod {
    type Err = String;

    fn from_str(text: &str) -> Result<CopyMethod, String> {
        CopyMethod::ALL
            .into_iter()
            .find(|method| method.name() == text)
            .ok_or_else(|| format!("unknown copy method {text:?}: kernel or calls"))
    }
}
