//! Byte-level BPE over pre-tokens, with the byte-to-character map of GPT-2.

use std::cell::RefCell;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::TokenizerError;

const NONE: u32 = u32::MAX;

/// Multiply-rotate hash (the rustc "Fx" scheme). The keys here are short byte strings and
/// id pairs from our own vocabulary, so HashDoS resistance buys nothing and SipHash would
/// cost a large share of the tokenizer's time.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
        }
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }
    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

pub(crate) type FxBuild = BuildHasherDefault<FxHasher>;
pub(crate) type FxMap<K, V> = HashMap<K, V, FxBuild>;

/// The GPT-2 byte map: printable Latin-1 bytes stand for themselves, the other 68 bytes
/// are moved, in order, to U+0100 and up so that every byte is a visible character.
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let keep = matches!(b, 33..=126 | 161..=172 | 174..=255);
        let cp = if keep {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(cp).unwrap_or('\0');
    }
    table
}

/// The inverse byte map, as a lookup on code points below 324.
pub(crate) fn char_to_byte_table() -> [Option<u8>; 324] {
    let mut inv = [None; 324];
    for (b, c) in byte_to_char_table().iter().enumerate() {
        inv[*c as usize] = Some(b as u8);
    }
    inv
}

/// Pieces longer than this bypass the cache: long pieces rarely repeat and would
/// crowd out the common short ones.
const MAX_CACHED_LEN: usize = 256;
const CACHE_CAPACITY: usize = 1 << 17;
/// Below this many symbols the quadratic scan beats a heap.
const HEAP_THRESHOLD: usize = 64;

static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

struct Cache {
    owner: u64,
    map: FxMap<Box<[u8]>, Box<[u32]>>,
    syms: Vec<u32>,
    ranks: Vec<u32>,
}

thread_local! {
    // Per thread, so `encode(&self)` needs no lock; keyed by the owning tokenizer instance.
    static CACHE: RefCell<Cache> = RefCell::new(Cache {
        owner: 0,
        map: FxMap::default(),
        syms: Vec::new(),
        ranks: Vec::new(),
    });
}

/// A BPE run with access to the thread's cache.
pub(crate) struct Session<'a> {
    bpe: &'a Bpe,
    cache: Option<&'a mut Cache>,
}

impl Session<'_> {
    /// Appends the ids of one pre-token (raw UTF-8 bytes) to `out`.
    #[inline]
    pub(crate) fn encode_piece(&mut self, piece: &[u8], out: &mut Vec<u32>) {
        let bpe = self.bpe;
        if piece.len() == 1 {
            let id = bpe.byte_ids[piece[0] as usize];
            if id != NONE {
                out.push(id);
            }
            return;
        }
        let Some(cache) = self.cache.as_deref_mut() else {
            let mut syms = Vec::new();
            bpe.merge_all(piece, &mut syms, &mut Vec::new());
            out.extend_from_slice(&syms);
            return;
        };
        if let Some(ids) = cache.map.get(piece) {
            out.extend_from_slice(ids);
            return;
        }
        bpe.merge_all(piece, &mut cache.syms, &mut cache.ranks);
        out.extend_from_slice(&cache.syms);
        if piece.len() <= MAX_CACHED_LEN {
            if cache.map.len() >= CACHE_CAPACITY {
                cache.map.clear();
            }
            cache.map.insert(piece.into(), cache.syms.as_slice().into());
        }
    }
}

pub(crate) struct Bpe {
    /// (left id, right id) packed into one u64 → (rank, merged id).
    merges: FxMap<u64, (u32, u32)>,
    /// Id of the one-character token of each byte, or NONE (the byte is then dropped, as
    /// the reference BPE does for characters outside the vocabulary without `unk_token`).
    byte_ids: [u32; 256],
    instance: u64,
}

#[inline]
fn pair_key(a: u32, b: u32) -> u64 {
    ((a as u64) << 32) | b as u64
}

impl Bpe {
    pub(crate) fn new(
        token_to_id: &HashMap<String, u32>,
        merges: &[(String, String)],
    ) -> Result<Bpe, TokenizerError> {
        let chars = byte_to_char_table();
        let mut byte_ids = [NONE; 256];
        let mut buf = [0u8; 4];
        for (b, c) in chars.iter().enumerate() {
            if let Some(&id) = token_to_id.get(&*c.encode_utf8(&mut buf)) {
                byte_ids[b] = id;
            }
        }
        let mut map = FxMap::with_capacity_and_hasher(merges.len(), FxBuild::default());
        for (rank, (a, b)) in merges.iter().enumerate() {
            let lookup = |s: &str| {
                token_to_id
                    .get(s)
                    .copied()
                    .ok_or_else(|| TokenizerError::MergeOutOfVocabulary(format!("{a} {b}")))
            };
            let ia = lookup(a)?;
            let ib = lookup(b)?;
            let merged = lookup(&format!("{a}{b}"))?;
            // A repeated pair keeps its last rank, as a map built from the list would.
            map.insert(pair_key(ia, ib), (rank as u32, merged));
        }
        Ok(Bpe {
            merges: map,
            byte_ids,
            instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
        })
    }

    #[inline]
    fn rank(&self, a: u32, b: u32) -> (u32, u32) {
        self.merges
            .get(&pair_key(a, b))
            .copied()
            .unwrap_or((NONE, NONE))
    }

    /// Runs `f` with an encoding session bound to this thread's piece cache; borrowing the
    /// thread-local once per call keeps its cost out of the per-piece path.
    pub(crate) fn with_session<R>(&self, f: impl FnOnce(&mut Session<'_>) -> R) -> R {
        CACHE.with(|cell| match cell.try_borrow_mut() {
            Ok(mut cache) => {
                if cache.owner != self.instance {
                    cache.map.clear();
                    cache.owner = self.instance;
                }
                f(&mut Session {
                    bpe: self,
                    cache: Some(&mut cache),
                })
            }
            // Nested use on one thread (a callback encoding inside an encode): no cache.
            Err(_) => f(&mut Session {
                bpe: self,
                cache: None,
            }),
        })
    }

    /// Runs the merges on `piece`, leaving the final ids in `syms`.
    pub(crate) fn merge_all(&self, piece: &[u8], syms: &mut Vec<u32>, ranks: &mut Vec<u32>) {
        syms.clear();
        syms.extend(
            piece
                .iter()
                .map(|&b| self.byte_ids[b as usize])
                .filter(|&id| id != NONE),
        );
        if syms.len() < 2 {
            return;
        }
        if syms.len() <= HEAP_THRESHOLD {
            self.merge_scan(syms, ranks);
        } else {
            self.merge_heap(syms);
        }
    }

    /// Lowest rank first, leftmost among equal ranks: a linear scan per merge.
    fn merge_scan(&self, syms: &mut Vec<u32>, ranks: &mut Vec<u32>) {
        ranks.clear();
        ranks.extend(syms.windows(2).map(|w| self.rank(w[0], w[1]).0));
        loop {
            let mut best = NONE;
            let mut at = 0;
            for (k, &r) in ranks.iter().enumerate() {
                if r < best {
                    best = r;
                    at = k;
                }
            }
            if best == NONE {
                break;
            }
            let merged = self.rank(syms[at], syms[at + 1]).1;
            syms[at] = merged;
            syms.remove(at + 1);
            ranks.remove(at);
            if at > 0 {
                ranks[at - 1] = self.rank(syms[at - 1], merged).0;
            }
            if at < ranks.len() {
                ranks[at] = self.rank(merged, syms[at + 1]).0;
            }
        }
    }

    /// Same order as `merge_scan` (rank, then original position), in O(n log n).
    fn merge_heap(&self, syms: &mut Vec<u32>) {
        let n = syms.len();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut next: Vec<usize> = (1..=n).collect();
        let mut alive = vec![true; n];
        let mut heap = BinaryHeap::with_capacity(n);
        for i in 0..n - 1 {
            let (r, _) = self.rank(syms[i], syms[i + 1]);
            if r != NONE {
                heap.push(std::cmp::Reverse((r, i)));
            }
        }
        while let Some(std::cmp::Reverse((r, i))) = heap.pop() {
            if !alive[i] || next[i] >= n {
                continue;
            }
            let j = next[i];
            let (cur, merged) = self.rank(syms[i], syms[j]);
            if cur != r {
                continue;
            }
            syms[i] = merged;
            alive[j] = false;
            next[i] = next[j];
            if next[j] < n {
                prev[next[j]] = i;
            }
            if prev[i] < n {
                let p = prev[i];
                let (pr, _) = self.rank(syms[p], merged);
                if pr != NONE {
                    heap.push(std::cmp::Reverse((pr, p)));
                }
            }
            if next[i] < n {
                let (nr, _) = self.rank(merged, syms[next[i]]);
                if nr != NONE {
                    heap.push(std::cmp::Reverse((nr, i)));
                }
            }
        }
        let mut k = 0;
        for i in 0..n {
            if alive[i] {
                syms[k] = syms[i];
                k += 1;
            }
        }
        syms.truncate(k);
    }

    #[cfg(test)]
    pub(crate) fn merge_both_ways(&self, piece: &[u8]) -> (Vec<u32>, Vec<u32>) {
        let mut a: Vec<u32> = piece
            .iter()
            .map(|&b| self.byte_ids[b as usize])
            .filter(|&id| id != NONE)
            .collect();
        let mut b = a.clone();
        if a.len() >= 2 {
            self.merge_scan(&mut a, &mut Vec::new());
            self.merge_heap(&mut b);
        }
        (a, b)
    }
}
