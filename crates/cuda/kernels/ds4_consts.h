// Numbers that both the kernels and their Rust launchers use, defined once here.
// build.rs puts this file first in the kernel source (for nvcc and NVRTC alike) and
// writes each `#define NAME VALUE // rust: TYPE` line as `pub const NAME: TYPE = VALUE;`
// into the crate's `consts` module, so the two sides cannot drift apart. Integer
// literals only; what each number means is said where the kernels use it.

// Warps per block of the matvec kernels (one warp per output row).
#define ROWS_PER_BLOCK 8 // rust: u32
// Rows per warp of the int8 expert kernels (matvec_q8act.cu).
#define EXP_ROWS_PER_WARP 4 // rust: u32
// Steps of 32 lanes per row of the register-activation IQ2_XXS kernels (4096 columns).
#define IQ2_RX_STEPS 2 // rust: usize
// Rows per warp of matvec_q8_0_q8_r4 (`q8_rows`).
#define Q8_ROWS_PER_WARP 4 // rust: u32
// The 32-copy IQ2_XXS tables of matvec_iq2_xxs_q8_rxtl (`iq2_lut32`): their words
// (384 entries × 32 lanes) and the dynamic shared memory a block asks for (the tables
// and up to 32 KB to reach a 32 KB boundary).
#define IQ2_LUT32_WORDS 12288 // rust: usize
#define IQ2_LUT32_SMEM 81920 // rust: usize
// The dynamic shared memory of matvec_iq2_xxs_q8_rxtm (`iq2_prmt`): 128 KB, so that the
// block's window covers 0xC000-0x20000 (the sign and code tables around its 64 KB boundary).
#define IQ2_PRMT_SMEM 131072 // rust: usize
// Most warps a row tile (and a block) of the tensor-core multi-token Q8_0 kernels
// (mma_tokens.cu).
#define MMA_TOKENS_MAX_KS 16 // rust: usize
// Pairs of Q8_0 blocks a warp's step takes in those kernels at 8 tokens (half at 16):
// a warp takes whole steps, so the launcher gives a tile no more warps than steps.
#define TMMA_UNROLL 4 // rust: usize

// Storage type codes of small dense tensors passed to the layer kernels.
#define WT_F32 0 // rust: i32
#define WT_F16 1 // rust: i32
#define WT_BF16 2 // rust: i32
// Most hyper-connection streams the kernels take, and hc_pre's value groups of 4 per
// thread (layer.cu).
#define HC_PRE_VEC 2 // rust: usize
#define HC_MAX 5 // rust: usize
// The HC boundary of `hc_gram` (layer_hcgram.cu): the streams and mix rows it takes
// (the model's 4 and (2 + 4)·4), the values of a block's share (the 24 mix dots, then
// the 10 products H'_j·H'_j' for j ≤ j'), and the threads of hc_post_gram's blocks (one
// column each) and hc_start_gram's (4 columns each).
#define HCG_STREAMS 4 // rust: usize
#define HCG_MIX 24 // rust: usize
#define HCG_PARTS 34 // rust: usize
#define HCG_POST_THREADS 128 // rust: usize
#define HCG_START_THREADS 128 // rust: usize

// Rows per shared-memory batch of attention_split_staged (layer_attention.cu).
#define ATT_STAGE_ROWS 32 // rust: usize
// indexer_step (layer_indexer_step.cu, `idx_step`): rows of its wide tile, live rows
// up to which its tiles are 16 rows, blocks a cluster, the row stride (floats) of its
// staged queries and rows, and its dynamic shared memory (the 64 queries and a wide
// tile: (64 + IXS_ROWS) · IXS_LD floats).
#define IXS_ROWS 64 // rust: usize
#define IXS_NARROW_MAX 2048 // rust: usize
#define IXS_CLUSTER 8 // rust: usize
#define IXS_LD 132 // rust: usize
#define IXS_SMEM 67584 // rust: usize
// The one attention shape of attention_prefill_mma (mma_attention.cu).
#define AMMA_HEADS 64 // rust: usize
#define AMMA_HD 512 // rust: usize

// The per-row KV table of a batched step over several sessions (KvTable in the Rust
// launchers): for each row (token) KVT_STRIDE u64 — the device addresses of that row's
// session's ring, main compressor state (kv, scores) and rows, indexer compressor
// state (kv, scores) and rows, then its ring capacity (an integer).
#define KVT_STRIDE 8 // rust: usize
#define KVT_RING 0 // rust: usize
#define KVT_SKV 1 // rust: usize
#define KVT_SSC 2 // rust: usize
#define KVT_COMP 3 // rust: usize
#define KVT_ISKV 4 // rust: usize
#define KVT_ISSC 5 // rust: usize
#define KVT_INDEX 6 // rust: usize
#define KVT_RAW_CAP 7 // rust: usize
