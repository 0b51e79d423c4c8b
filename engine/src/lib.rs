//! The kvforge engine: a LLaMA forward pass in `tch` (libtorch) on CPU and
//! CUDA, with its KV cache in fixed-size blocks handed out by
//! `kvforge-pool`, and the `kvforge` command line.
//!
//! # Layers
//!
//! * [`gguf`]: a GGUF reader (metadata, tensor table, dequantization).
//! * [`tokenizer`]: GPT-2 byte-level BPE from GGUF metadata or
//!   `tokenizer.json`; the ChatML template.
//! * [`model`]: [`Llama`] — weights and the forward pass over a [`KvStore`].
//! * [`cache`]: [`PagedKvCache`] — the tensors behind the blocks of the
//!   tensor-free [`Coordinator`] (`kvforge-coordinator`, which owns the
//!   block tables, tiered pools, prefix index and policies): each forward
//!   step plans, carries the plan out (writes, quantization into the cold
//!   tier, [`KvQuant`]), attends, and commits or aborts. Also
//!   [`ContiguousCache`], a test oracle.
//! * [`attention`]: the [`AttentionBackend`] seam and its
//!   [`ReferenceBackend`] (gather + SDPA over a [`StepView`]);
//!   [`fused`]: [`FusedBackend`], decode steps through `kvforge-kernels`'
//!   paged attention (the table read in place, one pass).
//! * [`generate`]: seeded sampling and the generation loop.
//! * [`ppl`]: window and streaming perplexity over the cache.
//! * [`manager`]: [`CacheManager`] — prefix reuse across turns, requests and
//!   sessions through a `kvforge-prefix` index, with metrics;
//!   [`metrics`]: the same snapshot in Prometheus' text format.
//!
//! # Invariants
//!
//! * The paged cache never reads a slot it did not write for that sequence:
//!   positions map to `block.index() * block_size + offset` through the
//!   sequence's own block table.
//! * A failed forward step leaves the sequence's length unchanged.
//! * Every bad input (file, request, parameter, device) is an
//!   [`EngineError`] with a one-line message; nothing on those paths panics.

#![deny(missing_docs)]

pub mod attention;
pub mod batch;
pub mod cache;
pub mod constrain;
mod detokenize;
mod engine;
mod error;
pub mod fused;
pub mod generate;
pub mod gguf;
pub mod input;
pub mod kv;
pub mod lifecycle;
pub mod logprobs;
pub mod manager;
pub mod mechanisms;
pub mod metrics;
pub mod model;
pub mod numerics;
pub mod policies;
pub mod ppl;
mod step;
mod tier;
pub mod tokenizer;

pub use attention::{Attended, AttentionBackend, KvTensors, Observe, ReferenceBackend, StepView};
pub use cache::{PagedKvCache, Sequence};
pub use constrain::{Constrained, Constraint};
pub use detokenize::Detokenizer;
pub use engine::{
    Attention, Engine, EngineConfig, cuda_devices, parse_device, parse_dtype, set_cpu_threads,
    synchronize,
};
pub use error::{EngineError, Result};
pub use fused::FusedBackend;
pub use generate::{Generation, Sampler, SamplingParams};
pub use kv::{ContiguousCache, KvDims, KvStore};
pub use kvforge_coordinator::{
    Coordinator, CoordinatorConfig, DedupConfig, EvictionConfig, LabelSource, Lack,
    LifecycleConfig, Score, Shortfall, SimHashConfig, Trigger,
};
pub use kvforge_kernels::DEFAULT_MIN_SPLIT;
pub use kvforge_kernels::Isa;
pub use kvforge_quant::Axis;
pub use lifecycle::LifecycleReport;
pub use logprobs::TokenLogprob;
pub use manager::{CacheManager, IndexKind, ReuseConfig, SessionId, TurnReport, TurnTail};
pub use mechanisms::{Mechanisms, Registry};
pub use model::{Llama, LlamaConfig};
pub use policies::Policies;
pub use ppl::PplReport;
/// Where `cargo xtask setup` puts the default model, relative to the
/// checkout: every command's `--model` default, and the tests' model.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The libtorch types in the engine's public API: where weights and KV live,
/// their dtypes, and the tensors a [`KvStore`] or [`AttentionBackend`]
/// implementation handles. Front ends need none of them to run requests
/// ([`Engine::prefill`], [`Engine::decode`] take ids and return logits).
pub use tch::{Device, Kind, Tensor};
pub use tier::{ColdBlock, KvQuant};
pub use tokenizer::{Message, Tokenizer};
