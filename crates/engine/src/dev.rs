//! Developer access to the engine's internals, for the tools (`ds4-tool`, `ds4-bench`,
//! the GPU checks) and the tests: the model config and tensor layout, the loaded
//! [`Model`], the [`Backend`] boundary and its CPU and CUDA implementations, the host
//! KV cache, the CPU ops. Nothing here is a stable API; the CLI and the server use
//! only the crate root.
//!
//! [`SessionExt`] and [`EngineExt`] add the model-level constructors and accessors to
//! [`Session`] and [`Engine`] (bring them into scope with `use ds4_engine::dev::*`).

use std::sync::Arc;

pub use crate::backend::{Backend, CyclePicks, GreedyCycle, GreedyRun, HcSource, LogitRows};
pub use crate::config::{Config, ConfigError};
pub use crate::cpu::CpuBackend;
#[cfg(feature = "cuda")]
pub use crate::cuda::{driver_present, CudaBackend, CudaError, CudaWeights, Gpu};
pub use crate::kv::{Frontier, KvCache, LayerCache};
pub use crate::layout::{check_layout, ExpertQuant, LayoutIssue, Role, TensorSpec};
pub use crate::model::{LoadOptions, Model};

use crate::engine::{Engine, EngineOptions};
use crate::error::Result;
use crate::ops::linear::Numerics;
use crate::session::{Session, SessionOptions};

/// `pub mod NAME { pub use crate::NAME::*; }`: an internal module opened to the tools
/// (the crate keeps its modules `pub(crate)`, which cannot be re-exported as they are).
macro_rules! reexport {
    ($($(#[$meta:meta])* $name:ident;)*) => {
        $(
            $(#[$meta])*
            pub mod $name {
                pub use crate::$name::*;
            }
        )*
    };
}

reexport! {
    /// The hyperparameters, read from `deepseek4.*` metadata ([`Config`]).
    config;
    /// The expected tensor table of a config and checks of a file against it.
    layout;
    /// The model's operations on the CPU (the reference math).
    ops;
    /// The tensors of a loaded model, bound per layer.
    weights;
    /// The host KV cache: the CPU backend's state and every backend's exported form.
    kv;
    /// The MTP draft block: its tensor layout, weights and CPU forward.
    mtp;
    /// The `DSV4` session payload layout ([`Session::save_payload`]).
    payload;
    /// Directional steering: the direction file and the projection.
    steer;
    /// The CUDA backend: device weights, sessions, the device runtime.
    #[cfg(feature = "cuda")]
    cuda;
}

/// Runs main layer `il` of `model` on the CPU over the HC states `h`
/// (`[n][n_hc][n_embd]`) of `tokens` at positions `pos0..`, with `cache` as its state:
/// the layer code the forward pass and the MTP block share (tests compare the two).
#[allow(clippy::too_many_arguments)]
pub fn cpu_layer_forward(
    model: &Model,
    il: usize,
    numerics: Numerics,
    pos0: usize,
    tokens: &[u32],
    h: &mut [f32],
    cache: &mut LayerCache,
) {
    let m = model.inner();
    crate::cpu::forward::layer_forward(
        &m.config,
        &m.weights.layers[il],
        &m.ropes[il],
        numerics,
        pos0,
        tokens,
        h,
        cache,
        None,
    );
}

/// Model-level constructors and accessors of [`Session`].
pub trait SessionExt: Sized {
    /// A CPU session of `ctx` tokens with the model's numerics.
    fn new(model: &Model, ctx: usize) -> Result<Self>;
    /// A CPU session (rayon's global pool).
    fn with_options(model: &Model, opts: SessionOptions) -> Result<Self>;
    /// A session on `backend`, which must start empty.
    fn with_backend(
        model: &Model,
        backend: Box<dyn Backend>,
        numerics: Numerics,
        prefill_chunk: usize,
    ) -> Self;
    fn backend(&self) -> &dyn Backend;
    fn model(&self) -> &Model;
}

impl SessionExt for Session {
    fn new(model: &Model, ctx: usize) -> Result<Session> {
        Session::cpu(model, SessionOptions::new(ctx), None)
    }

    fn with_options(model: &Model, opts: SessionOptions) -> Result<Session> {
        Session::cpu(model, opts, None)
    }

    fn with_backend(
        model: &Model,
        backend: Box<dyn Backend>,
        numerics: Numerics,
        prefill_chunk: usize,
    ) -> Session {
        Session::on_backend(model, backend, numerics, prefill_chunk)
    }

    fn backend(&self) -> &dyn Backend {
        self.backend_ref()
    }

    fn model(&self) -> &Model {
        self.model_ref()
    }
}

/// Model-level constructors and accessors of [`Engine`].
pub trait EngineExt: Sized {
    /// An engine over a model already loaded (in-memory models of tools and tests);
    /// `opts.numerics` replaces the model's.
    fn from_model(model: Model, opts: EngineOptions) -> Result<Self>;
    fn model(&self) -> &Model;
    /// The uploaded weights when the engine runs on CUDA (their `gpu` has the
    /// profiling and tracing hooks).
    #[cfg(feature = "cuda")]
    fn cuda_weights(&self) -> Option<&Arc<CudaWeights>>;
    /// The CPU pool of a `Cpu { threads: Some(_) }` engine.
    fn cpu_pool(&self) -> Option<&Arc<rayon::ThreadPool>>;
}

impl EngineExt for Engine {
    fn from_model(model: Model, opts: EngineOptions) -> Result<Engine> {
        Engine::open_model(model, opts)
    }

    fn model(&self) -> &Model {
        self.model_ref()
    }

    #[cfg(feature = "cuda")]
    fn cuda_weights(&self) -> Option<&Arc<CudaWeights>> {
        self.cuda_weights_ref()
    }

    fn cpu_pool(&self) -> Option<&Arc<rayon::ThreadPool>> {
        self.cpu_pool_ref()
    }
}

/// Whole-model checks against the tiny fixtures' official logits, and (CUDA builds) the
/// fixtures on the GPU with each decode-graph restructuring off and on.
pub mod fixture {
    pub use crate::dev_fixture::*;
}
