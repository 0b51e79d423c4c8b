//! The one error type of `kvforge-engine`.

/// Everything the engine reports to its callers. Each message is one line
/// that names the problem.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A missing, unreadable, corrupt or truncated model file or directory.
    #[error("model: {0}")]
    Model(String),
    /// A valid file this engine cannot run (tensor type, architecture).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Tokenizer construction or encoding failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A request that cannot be served as given.
    #[error("invalid request: {0}")]
    Request(String),
    /// Invalid sampling parameters.
    #[error("invalid sampling parameters: {0}")]
    Sampling(String),
    /// The KV cache has no room for a step: which one, and what ran out
    /// in numbers (bytes over the budget, or blocks of a tier). Nothing
    /// was taken; the caller may wait, free a sequence and retry, or
    /// refuse.
    #[error("KV cache full: {0}")]
    CacheFull(kvforge_coordinator::Shortfall),
    /// The device cannot be used (no GPU, CPU-only libtorch).
    #[error("device: {0}")]
    Device(String),
    /// An error from libtorch.
    #[error("libtorch: {0}")]
    Torch(String),
    /// An error from the block pool.
    #[error(transparent)]
    Pool(#[from] kvforge_pool::PoolError),
    /// An error from the prefix index.
    #[error(transparent)]
    Prefix(#[from] kvforge_prefix::PrefixError),
    /// A bad quantization setting, or K/V that cannot be quantized.
    #[error(transparent)]
    Quant(#[from] kvforge_quant::QuantError),
    /// A cache configuration or a coordinator call that cannot work.
    #[error(transparent)]
    Cache(kvforge_coordinator::CoordError),
}

impl From<kvforge_coordinator::CoordError> for EngineError {
    fn from(e: kvforge_coordinator::CoordError) -> Self {
        use kvforge_coordinator::CoordError as C;
        match e {
            C::Pool(e) => EngineError::Pool(e),
            C::Prefix(e) => EngineError::Prefix(e),
            C::Quant(e) => EngineError::Quant(e),
            other => EngineError::Cache(other),
        }
    }
}

/// A kernel's refusal: what the kernel cannot do here is `Unsupported`,
/// a malformed input a `Request` error.
impl From<kvforge_kernels::KernelError> for EngineError {
    fn from(e: kvforge_kernels::KernelError) -> Self {
        match e {
            kvforge_kernels::KernelError::Unsupported(s) => EngineError::Unsupported(s),
            other => EngineError::Request(other.to_string()),
        }
    }
}

impl EngineError {
    /// The message without the category prefix.
    pub fn detail(&self) -> String {
        match self {
            EngineError::Model(s)
            | EngineError::Unsupported(s)
            | EngineError::Tokenizer(s)
            | EngineError::Request(s)
            | EngineError::Sampling(s)
            | EngineError::Device(s)
            | EngineError::Torch(s) => s.clone(),
            EngineError::CacheFull(s) => s.to_string(),
            EngineError::Pool(e) => e.to_string(),
            EngineError::Prefix(e) => e.to_string(),
            EngineError::Quant(e) => e.to_string(),
            EngineError::Cache(e) => e.to_string(),
        }
    }
}

impl From<tch::TchError> for EngineError {
    fn from(e: tch::TchError) -> Self {
        // libtorch messages carry a C++ backtrace after the first line.
        let s = e.to_string();
        EngineError::Torch(s.lines().next().unwrap_or("").to_string())
    }
}

/// `Result` with [`EngineError`].
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
