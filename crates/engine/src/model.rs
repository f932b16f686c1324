//! A loaded model: config, mmap'd weights bound per layer, RoPE tables.

use std::path::Path;
use std::sync::Arc;

use ds4_gguf::GgufFile;

use crate::config::Config;
use crate::error::{EngineError, Result};
use crate::ops::linear::Numerics;
use crate::ops::rope::Rope;
use crate::weights::Weights;

#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// The default numeric mode of sessions on this model.
    pub numerics: Numerics,
}

pub(crate) struct ModelInner {
    pub(crate) config: Config,
    pub(crate) weights: Weights,
    /// One RoPE per layer (plain or YaRN by compress ratio).
    pub(crate) ropes: Vec<Rope>,
    pub(crate) numerics: Numerics,
    pub(crate) file: Arc<GgufFile>,
}

/// A loaded model. Cloning is cheap (shared).
#[derive(Clone)]
pub struct Model {
    inner: Arc<ModelInner>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("name", &self.inner.config.name)
            .field("n_layer", &self.inner.config.n_layer)
            .field("numerics", &self.inner.numerics)
            .finish()
    }
}

impl Model {
    /// Opens (mmaps) a GGUF file, reads the config and binds every tensor.
    pub fn load(path: impl AsRef<Path>, opts: LoadOptions) -> Result<Model> {
        let path = path.as_ref();
        let file = GgufFile::open(path).map_err(|source| EngineError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        Model::from_gguf(Arc::new(file), opts)
    }

    pub fn from_gguf(file: Arc<GgufFile>, opts: LoadOptions) -> Result<Model> {
        let config = Config::from_gguf(&file)?;
        let weights = Weights::bind(&config, &file)?;
        let ropes = (0..config.n_layer)
            .map(|il| Rope::for_layer(&config, il))
            .collect();
        Ok(Model {
            inner: Arc::new(ModelInner {
                config,
                weights,
                ropes,
                numerics: opts.numerics,
                file,
            }),
        })
    }

    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    pub fn weights(&self) -> &Weights {
        &self.inner.weights
    }

    pub fn numerics(&self) -> Numerics {
        self.inner.numerics
    }

    pub fn gguf(&self) -> &GgufFile {
        &self.inner.file
    }

    /// The tokenizer from the file's `tokenizer.ggml.*` metadata.
    pub fn tokenizer(&self) -> Result<ds4_tokenizer::Tokenizer> {
        crate::tokenizer::from_gguf(self.gguf())
    }

    pub(crate) fn inner(&self) -> &ModelInner {
        &self.inner
    }
}
