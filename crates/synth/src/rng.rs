//! A small, fast, seedable generator for synthetic weights. Streams are derived from
//! (seed, tensor, chunk) so parallel generation is deterministic.

#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A stream for one (seed, a, b) triple.
    pub fn stream(seed: u64, a: u64, b: u64) -> Rng {
        let mut r = Rng(seed ^ 0x9e37_79b9_7f4a_7c15);
        r.0 ^= r
            .next_u64()
            .wrapping_add(a.wrapping_mul(0xd1b5_4a32_d192_ed03));
        r.0 ^= r
            .next_u64()
            .wrapping_add(b.wrapping_mul(0x8cb9_2ba7_2f3d_8dd7));
        r
    }

    /// SplitMix64.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, n).
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() >> 32) * n) >> 32
    }

    /// Uniform in [0, 1).
    #[inline]
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Approximately standard normal (sum of four uniforms, rescaled): cheap, bounded,
    /// and plenty for random weights.
    #[inline]
    pub fn normal(&mut self) -> f32 {
        let x = self.next_u64();
        let s: u32 = (0..4).map(|i| ((x >> (16 * i)) & 0xffff) as u32).sum();
        (s as f32 / 65535.0 - 2.0) * 1.732_050_8
    }

    pub fn fill_bytes(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let v = self.next_u64().to_le_bytes();
        let n = rest.len();
        rest.copy_from_slice(&v[..n]);
    }
}
